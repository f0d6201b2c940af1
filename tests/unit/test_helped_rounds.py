"""The DeepSpeed trainer's side of gradient helpers (``pivot.actors.gradient_help``): which
rounds of a step the ranks run and which a helper takes, and what happens to a helper that
fails or is late."""

import torch

from pivot.actors.gradient_help import HelpedRounds
from pivot.actors.tensor_wire import tensors_to_wire
from pivot.actors.trainer_messages import HelperGradients
from pivot.grpo import LossSums


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rounds(n: int, world: int = 2, clock: Clock | None = None) -> HelpedRounds:
    # the plan only indexes micro-batches: any object stands for one
    return HelpedRounds(
        [[(r, j) for j in range(n)] for r in range(world)],  # type: ignore[misc]
        denominator=10.0,
        clock=clock or Clock(),
    )


def reply(value: float, tokens: float) -> HelperGradients:
    grads = {"w": torch.full((2,), value), "b": torch.tensor([value])}
    return HelperGradients(
        grads=tensors_to_wire(grads), sums=LossSums(tokens=tokens, loss=value).as_tensor().tolist()
    )


def drain(plan: HelpedRounds) -> list[int]:
    ran = []
    while (j := plan.next_round()) is not None:
        ran.append(j)
    return ran


def test_a_helper_takes_the_last_rounds_in_proportion_to_its_devices() -> None:
    plan = rounds(10)
    assert plan.next_round() == 0
    # 9 open; one device against two ranks: a third of them, from the end
    assert plan.claim("rollout-7", [7]) == [7, 8, 9]
    assert plan.batches([7]) == [(0, 7), (1, 7)]  # every rank's micro-batch of the round
    # 6 open; two devices against the ranks' two and the one helper's out: 2.4
    assert plan.claim("reward-8", [8, 9]) == [5, 6]
    assert plan.next_round() == 1
    assert plan.claim("reward-10", [10]) == []  # 3 open, a sixth of them: none
    assert drain(plan) == [2, 3, 4]
    assert plan.claim("reward-10", [10]) == []  # none open
    plan.deliver("rollout-7", reply(1.0, 4.0))
    plan.deliver("reward-8", reply(0.5, 2.0))
    assert plan.settle() is False  # every helper back: the step is closed to helpers
    assert plan.claim("rollout-11", [11]) == []
    grads, sums = plan.gradients()
    assert grads is not None
    assert torch.equal(grads["w"], torch.full((2,), 1.5)) and torch.equal(
        grads["b"], torch.tensor([1.5])
    )
    assert (sums.tokens, sums.loss) == (6.0, 1.5)
    assert [s.replica for s in plan.spans()] == ["rollout-7", "reward-8"]


def test_a_helper_that_fails_gives_its_rounds_back_to_the_ranks() -> None:
    plan = rounds(6)
    assert plan.next_round() == 0
    assert plan.claim("rollout-7", [7]) == [4, 5]
    plan.deliver("rollout-7", None, RuntimeError("its agent died"))
    assert drain(plan) == [1, 2, 3]
    assert plan.settle() is True  # rounds 4 and 5 are open again
    assert drain(plan) == [4, 5]
    assert plan.settle() is False
    grads, sums = plan.gradients()
    assert grads is None and sums.tokens == 0.0


def test_a_late_helper_is_given_up_and_its_gradient_dropped() -> None:
    clock = Clock()
    plan = rounds(6, clock=clock)
    assert plan.next_round() == 0
    assert plan.claim("rollout-7", [7]) == [4, 5]
    clock.now = 0.04  # four rounds in 0.04 s: the ranks would run its two in 0.02 s
    assert drain(plan) == [1, 2, 3]
    assert plan.settle() is True  # it did not come in time: its rounds are open again
    plan.deliver("rollout-7", reply(1.0, 4.0))  # too late
    assert drain(plan) == [4, 5]
    assert plan.settle() is False
    grads, _ = plan.gradients()
    assert grads is None
