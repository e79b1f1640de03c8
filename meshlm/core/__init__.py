"""The author API: logical axes, annotations (``param_axes``, ``constrain``, ``block``), the
annotated layers of ``meshlm.nn``, scopes and ties.  Model code needs nothing else; without
``meshlm.shard`` every annotation is data and ``constrain`` is the identity."""
