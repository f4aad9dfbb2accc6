"""A ``sitecustomize`` for the vLLM processes ``kiloserve up`` starts (``launch.engines``).

``vllm_launch`` puts this folder first on the engine's ``PYTHONPATH``, so every Python
process of the engine (the API server, the engine core, each spawned worker) imports
``sitecustomize`` here at start-up: it asks Linux for permission to use AMX tiles
(``amx_permission``), then runs the ``sitecustomize`` it shadows, if any.
"""
