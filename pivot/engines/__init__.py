"""Inference engines: the protocol every backend implements (``protocol``), the rules for
releasing and resuming role context that they share (``context``), pivot's CPU torch engine
(``torch_engine``), the engine that costs virtual time by model (``sim_engine``) and the
tokenizer wrapper (``tokenizer``). Importing this package loads no torch."""
