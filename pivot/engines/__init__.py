"""Inference engines: the protocol every backend implements (``protocol``), the rules for
releasing and resuming role context that they share (``context``), which engine serves a
checkpoint folder, read without torch (``checkpoint``), and picking and loading it
(``loading``); pivot's CPU torch engine for the Llama-shaped families (``torch_engine``) and
the transformers fallback for any other causal LM (``hf_engine``), both built on the sequence
handling and sampling in ``stepping``; the engine that costs virtual time by model
(``sim_engine``), an engine whose outputs follow a script, for tests (``scripted``), the
conformance suite every engine passes (``conformance``) and the tokenizer wrapper
(``tokenizer``). Importing this package, ``checkpoint``, ``loading``, the scripted engine or
the conformance suite loads no torch."""
