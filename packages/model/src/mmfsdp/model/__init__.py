"""mmfsdp.model"""
