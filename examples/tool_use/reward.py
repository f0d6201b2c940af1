"""The tool_use example's reward (``reward.function = "reward.py:score"``): 1 for the right
product after the answer mark, else 0. The tool's text is part of the response the reward
reads, so a copied tool result is what earns it; a guess almost never does.
"""

import importlib.util
from pathlib import Path

from pivot.task import final_answer


def _beside(name: str):
    """A file of this example, imported (pivot loads this one by its path, not as a package)."""
    path = Path(__file__).resolve().with_name(name)
    spec = importlib.util.spec_from_file_location(f"tool_use_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _beside("rollout.py")


def score(sample) -> dict:
    answer = final_answer(sample.response)
    return {
        "score": float(answer == str(sample.reference)),
        "answered": float(answer is not None),  # the share of responses that gave an answer
        "tool_calls": float(tool.tool_calls(sample.response)),
    }
