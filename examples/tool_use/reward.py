"""The tool_use example's reward (``reward.function = "reward.py:score"``): 1 for the right
product after the answer mark, else 0. The tool's text is part of the response the reward
reads, so a copied tool result is what earns it; a guess almost never does.
"""

from pivot.task import final_answer


def score(sample) -> dict:
    answer = final_answer(sample.response)
    return {
        "score": float(answer == str(sample.reference)),
        "answered": float(answer is not None),  # the share of responses that gave an answer
    }
