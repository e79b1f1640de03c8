"""Interoperation with other ecosystems' formats: Hugging Face (``meshlm.interop.hf``)."""
