"""A trained run as a function: here, ImageGPT's completions of images (images.py)."""
