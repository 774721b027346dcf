"""mmfsdp.data"""
