"""The models pivot ships (tiny policy and GenRM, made by ``python -m pivot.cli.tinymodels``)."""

from pathlib import Path

#: The folder holding one Hugging Face checkpoint folder per shipped model.
ASSETS = Path(__file__).resolve().parent
