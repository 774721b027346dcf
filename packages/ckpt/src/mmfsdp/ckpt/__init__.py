"""mmfsdp.ckpt"""
