"""mmfsdp.train"""
