"""Training data: text and token files (text.py), image-caption pairs (images.py), the shapes
task drawn with Pillow (shapes.py), and the ``data`` config section (config.py)."""
