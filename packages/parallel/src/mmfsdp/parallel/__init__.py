"""mmfsdp.parallel"""
