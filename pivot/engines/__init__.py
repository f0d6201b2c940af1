"""Inference engines: the protocol every backend implements (``protocol``), the rules for
releasing and resuming role context that they share (``context``), pivot's CPU torch engine
(``torch_engine``), the engine that costs virtual time by model (``sim_engine``), an engine
whose outputs follow a script, for tests (``scripted``), the conformance suite every engine
passes (``conformance``) and the tokenizer wrapper (``tokenizer``). Importing this package, the
scripted engine or the conformance suite loads no torch."""
