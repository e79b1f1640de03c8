"""The optimizer over sharded parameters (sharded.py), where its flat collectives are cut
(chunks.py), and the reduction of a chunk's gradients as soon as backward makes them (early.py)."""
