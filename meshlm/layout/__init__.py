"""Layouts and meshes: the YAML rules that map logical axes to mesh axes (rules.py), named
device meshes (mesh.py), what a layout does on a given mesh (effective.py), the precision
policy (precision.py) and a layout's offload section (offload.py).  Pure data and checks:
nothing here moves a tensor."""
