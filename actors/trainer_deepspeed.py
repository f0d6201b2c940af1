"""The DeepSpeed training backend: ``DeepSpeedTrainer`` (a ``pivot.grpo.TrainingEngine`` on one
rank), the rank group that runs each command on every rank, ``DeepSpeedBackend`` (what the
``Trainer`` actor of ``pivot.actors.trainer`` drives on rank 0) and the processes of a
group, one per training rank (one CPU "device" each, torch pinned to its threads).

Ranks and who talks to whom. Every rank is a supervised child process with an actor, so a
Ctrl-C or a crash leaves no orphans (``add_trainer_group``). Only rank 0, the ``Trainer``
actor over a ``DeepSpeedBackend``, takes requests: TrainBatch, OffloadTrainer, ReloadTrainer,
QueryTrainer. The backend turns each into a command and broadcasts it over
torch.distributed (gloo, a group of its own);
every other rank (``TrainerFollower``) waits in that broadcast and runs the same command, so
all ranks make the same DeepSpeed calls in the same order (SPMD). A training command carries
the whole padded batch (small: token ids and a few floats per token); each rank takes its
data-parallel share (``GRPOBatch.shard``). After each step rank 0 writes the full updated
policy, in Hugging Face names, to the GPS host store as the new version. One actor per rank
with its own requests would have made the caller coordinate the ranks; this way the bus sees
one trainer, and the ranks stay in step by construction. Nothing is unpickled from the
group's sockets: commands travel as msgpack bytes in a uint8 tensor (``encode_command``),
RNG states and parameter digests as fixed-size uint8 tensors; no object collectives.

On CUDA (``cluster.accelerator = "cuda"``) each rank trains on its GPU (``gpu``:
``torch.cuda.set_device``, and LOCAL_RANK, which DeepSpeed's engine moves to; one rank per
GPU, ``pivot.accelerator``) in an NCCL group, in bf16 with ``model.dtype = "bfloat16"``
(DeepSpeed's ``bf16`` section: fp32 master weights in the optimizer); the command broadcast
stays on a gloo group of its own (host tensors). Everything else is the CPU path.

DeepSpeed on CPU (reference/platform-notes.md §2): gloo, fp32, torch's AdamW at ZeRO 1/2
(no FusedAdam JIT). ZeRO-3 builds the model under ``zero.Init`` and uses FusedAdam, since
DeepSpeed's ``offload_states`` refuses other optimizers at stage 3; its first use JIT-builds
the op (about 45 s, cached in ~/.cache/torch_extensions). ``offload_states`` /
``reload_states`` move CPU tensors to CPU here: they free nothing, but run the same path as on
GPUs. The ``deepspeed_shm_comm`` op, which DeepSpeed JIT-builds (about 30 s, a C++ toolchain
needed) on every first ``init_distributed``, serves only inference all-reduce; the trainer
skips building it.

A group cannot lose a rank (gloo has no way to shrink one), so its ranks are supervised as one
unit: when one dies, the others are stopped and all start again (``trainer_group``). The new
group loads the newest state it can (``pivot.actors.checkpoints.trainer_start``): the last
complete checkpoint when it holds the version GPS published last (exact), else that version's
weights from GPS with a fresh optimizer; rank 0 chooses, and the others load what it chose.
The GPS store is the job's, so it outlives a rank 0 that died (``ParameterStore(adopt=True)``).
A train command that fails is left unanswered (``Trainer``): nng's req socket resends the
Driver's request when the trainer it went to disconnects, so the step in flight reaches the
new group and is trained once, from the version it was made for.

Gradients are accumulated by the caller (DeepSpeed's ``managed_gradient_accumulation``
off): a step runs as many micro-batches as the rank's share needs, every rank the same
number (shards are padded with empty rows), then one ``engine.step()``. Where a step may take
gradient helpers (ZeRO-1/2, no KL term, a GPS store), rank 0 names each micro-batch round the
ranks run and folds the helpers' gradient in before the step (``BroadcastRounds``,
``pivot.actors.gradient_help``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import gc
import hashlib
import importlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch

from pivot.actors.assembly import ChildProcess, agent_name, trainer_names
from pivot.actors.checkpoints import Checkpoints, TrainerStart, read_checkpoint, trainer_start
from pivot.actors.faults import first_start, trainer_fault
from pivot.actors.gradient_help import HelpedRounds
from pivot.actors.tensor_wire import batch_from_wire, batch_to_wire
from pivot.actors.trainer import AskHelper, Trainer, TrainerOffloaded, TrainResult
from pivot.actors.trainer_messages import (
    ComputeGradients,
    GradientHelper,
    SimTrainBatch,
    TrainBatch,
    TrainerRestart,
    WireBatch,
)
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, Directory, RestartPolicy, Supervisor
from pivot.bus.codec import job_secret
from pivot.bus.supervisor import START_ENV
from pivot.config import convert
from pivot.engines.hf_engine import causal_lm_class
from pivot.grpo import (
    GRPOBatch,
    LossSums,
    TrainingSettings,
    TrainStats,
    build_batch,
    micro_batch_loss,
    token_logprobs,
    warmup_factor,
)
from pivot.timeline import HelperSpan

#: How long a collective may wait; followers wait for the next command in one, and a
#: batch can take a long time to roll out and score.
COMMAND_TIMEOUT = datetime.timedelta(days=7)
# DeepSpeed's name for the one state a checkpoint folder holds (it keeps tags side by side)
TRAINER_TAG = "state"
# what a Hugging Face folder holds beside the weights for its tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
_START_KEY = "pivot-trainer-start"  # where rank 0 leaves its choice in the rendezvous store


def _eager(fn):
    return fn


def import_deepspeed():
    """Import DeepSpeed quietly, without the shm_comm JIT build (see the module docstring) and
    without compiling its Muon optimizer's functions."""
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    for handler in ds_logger.handlers:  # DeepSpeed logs to stdout, which a child keeps for READY
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    # by name: ``deepspeed.comm.torch`` is shadowed by the ``torch`` that module imports
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    # ``deepspeed.initialize`` imports its Muon optimizer, whose functions are decorated
    # ``@compiler.compile()`` at import: each decoration sets up a torch.compile wrapper, about
    # 1.7 s of CPU per rank at every group start (inductor's set-up), for an optimizer this
    # trainer never builds (AdamW, or FusedAdam at ZeRO-3). Muon is its only user: eager.
    compiler = importlib.import_module("deepspeed.runtime.compiler")
    if hasattr(compiler, "compile"):
        compiler.compile = lambda: _eager
    return deepspeed


def init_process_group(
    rank: int, world_size: int, rendezvous: str, *, backend: str = "gloo", gpu: int | None = None
) -> None:
    """Join the trainer's process group (``backend``: ``pivot.accelerator.dist_backend``;
    ``rendezvous``: an init_method URL such as ``file:///run/trainer.rendezvous`` or
    ``tcp://127.0.0.1:PORT``) and set the environment DeepSpeed reads, so that it needs
    neither a launcher nor MPI discovery. ``gpu``: the rank's GPU on CUDA, its LOCAL_RANK:
    DeepSpeed's engine moves to ``cuda:LOCAL_RANK`` whatever device is current."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    local = rank if gpu is None else gpu
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
    )
    dist.init_process_group(
        backend,
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


# ---- the engine, on every rank --------------------------------------------------------------------


def deepspeed_config(settings: TrainingSettings, *, bf16: bool = False) -> dict[str, Any]:
    """The DeepSpeed config for these settings: fp32 throughout, or with ``bf16`` the model
    and its gradients in bf16 over fp32 master weights (``model.dtype = "bfloat16"``)."""
    zero: dict[str, Any] = {"stage": settings.zero_stage}
    if settings.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = settings.zero3_persistence_threshold
    precision = {"bf16": {"enabled": True}} if bf16 else {}
    return {
        **precision,
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": 1,
        # the caller owns the accumulation boundary: any number of micro-batches per step
        "managed_gradient_accumulation": False,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": settings.lr,
                "betas": list(settings.adam_betas),
                "eps": settings.adam_eps,
                "weight_decay": settings.weight_decay,
                # stage 3 offloads optimizer state only with DeepSpeed's FusedAdam
                "torch_adam": settings.zero_stage != 3,
            },
        },
        "zero_optimization": zero,
        "gradient_clipping": settings.grad_clip,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    """``TrainingEngine`` on one rank of an initialised process group (every rank makes the same
    calls). Loads whatever Hugging Face causal-LM folder ``AutoModelForCausalLM`` loads; trains
    in fp32, or in bf16 with ``bf16`` (on a GPU: the group's rank is on its device, see
    ``init_process_group``). ``resume``: a checkpoint's ``trainer/`` to continue from (``checkpoint`` is then
    its ``policy/``). ``gps``: a GPS store whose published version replaces the weights of
    ``checkpoint`` and becomes this trainer's version, with a fresh optimizer and the learning
    rate schedule at that step (a group restarted without a checkpoint of that version)."""

    def __init__(
        self,
        checkpoint: str | Path,
        settings: TrainingSettings | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        resume: str | Path | None = None,
        gps: str | None = None,
        bf16: bool = False,
    ) -> None:
        import torch.distributed as dist
        from transformers import AutoConfig

        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedTrainer needs torch.distributed: init_process_group first")
        deepspeed = import_deepspeed()
        self.settings = settings = settings or TrainingSettings()
        self.checkpoint = str(checkpoint)
        self.clock = clock
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._deepspeed = deepspeed
        deepspeed.init_distributed(dist_backend=dist.get_backend())

        config = AutoConfig.from_pretrained(self.checkpoint)
        model_class = causal_lm_class(config)
        config.use_cache = False
        self.config = config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        ds_config = deepspeed_config(settings, bf16=bf16)
        torch.manual_seed(settings.seed)
        if settings.zero_stage == 3:
            # built partitioned, without Hugging Face's weight init (it indexes into
            # parameters that are empty on this rank); the checkpoint's weights come next
            with deepspeed.zero.Init(config_dict_or_path=ds_config), _no_init_weights():
                model = model_class(config)
            model.tie_weights()
            self._load_partitioned(model, gps)
        else:
            model = model_class.from_pretrained(self.checkpoint, config=config, dtype=torch.float32)
            if gps is not None:  # in place: state_dict's tensors share the parameters' storage
                self._version = _read_gps(gps, dict(model.state_dict()))
        model.train()
        scheduler = functools.partial(_warmup_scheduler, warmup_steps=settings.warmup_steps)
        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds_config,
            lr_scheduler=scheduler,
        )
        self._reference = None
        if settings.kl_coef > 0.0:
            # a frozen whole copy on every rank: fine for the policies pivot trains on CPU
            self._reference = (
                model_class.from_pretrained(
                    self.checkpoint, config=config, dtype=torch.bfloat16 if bf16 else torch.float32
                )
                .to(self.engine.device)
                .eval()
            )
            self._reference.requires_grad_(False)
        if gps is None:
            self._version = 0
        else:
            self._schedule_at(self._version)
        if resume is not None:
            self._resume(Path(resume))
        self._offloaded = False
        # what exists now lives as long as the process: keep it out of the collector's way.
        # DeepSpeed's offload_states runs gc.collect three times, ~0.8 s each over the
        # objects of torch + transformers + deepspeed, ~1 ms each once they are frozen
        gc.collect()
        gc.freeze()
        # pinned host memory needs an accelerator; on CPU it is plain memory anyway
        self._pin = torch.cuda.is_available()

    def _load_partitioned(self, model: torch.nn.Module, gps: str | None) -> None:
        from pivot.engines.loading import read_weights

        # every rank reads the names, so that a bad checkpoint fails on all of them alike
        # (not one rank inside a gather the others wait in); rank 0 copies the values
        tensors = read_weights(self.checkpoint)
        if gps is not None:
            self._version = _read_gps(gps, tensors)
        if self.config.tie_word_embeddings:
            # saved under the input embedding's name; the output embedding may be a
            # parameter of its own here, whatever the architecture calls the two
            named = list(model.named_parameters(remove_duplicate=False))

            def name_of(param: torch.nn.Parameter) -> str:
                return next(n for n, p in named if p is param)

            embed = name_of(model.get_input_embeddings().weight)
            head = name_of(model.get_output_embeddings().weight)
            tensors.setdefault(head, tensors[embed])
        missing = [name for name, _ in model.named_parameters() if name not in tensors]
        if missing:
            raise ValueError(f"{self.checkpoint}: no tensors for parameters {missing[:5]}")
        for name, param in model.named_parameters():
            with self._deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.rank == 0:
                    with torch.no_grad():
                        param.copy_(tensors[name])

    def _schedule_at(self, version: int) -> None:
        """The learning rate schedule at step ``version`` (as ``version`` steps would leave it)."""
        import warnings

        scheduler = self.engine.lr_scheduler
        scheduler.last_epoch = version - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore")
            scheduler.step()

    def _resume(self, folder: Path) -> None:
        """Optimizer, scheduler and the rank's RNG from a checkpoint ``save`` wrote; the
        model was built from that checkpoint's policy folder already."""
        path, state = self.engine.load_checkpoint(
            str(folder), tag=TRAINER_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise ValueError(f"{folder}: no DeepSpeed checkpoint tagged {TRAINER_TAG!r}")
        self._version = int(state["version"])
        torch.set_rng_state(state["rng"][self.rank])

    def save(self, folder: Path) -> None:
        """A checkpoint of this step into ``folder`` (every rank calls it: under ZeRO-3 the
        export gathers, and DeepSpeed writes each rank's optimizer partition): ``policy/``,
        the weights as a Hugging Face folder any causal-LM loader reads (config, safetensors,
        generation config and the tokenizer files of the folder trained from), and
        ``trainer/``, DeepSpeed's checkpoint with optimizer and scheduler state."""
        import torch.distributed as dist

        if self._offloaded:
            raise TrainerOffloaded("the trainer's state is offloaded: reload before saving")
        tensors = self.export()
        if self.rank == 0:
            policy = folder / "policy"
            self.engine.module.save_pretrained(
                policy, state_dict={k: v.contiguous() for k, v in tensors.items()}
            )
            for name in TOKENIZER_FILES:
                source = Path(self.checkpoint) / name
                if source.is_file():
                    shutil.copyfile(source, policy / name)
        # the test kit's fault: a trainer that dies with the policy written, the rest not
        trainer_fault("crash-in-checkpoint", self._version, self.rank)
        # a uint8 tensor of one size on every rank: a tensor collective, nothing unpickled
        state = torch.get_rng_state()
        rngs = [torch.empty_like(state) for _ in range(self.world_size)]
        dist.all_gather(rngs, state)
        self.engine.save_checkpoint(
            str(folder / "trainer"),
            tag=TRAINER_TAG,
            client_state={"version": self._version, "rng": rngs},
            save_latest=False,
        )

    # -- TrainingEngine

    @property
    def version(self) -> int:
        return self._version

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    @property
    def zero_stage(self) -> int:
        return self.settings.zero_stage

    @property
    def takes_helpers(self) -> bool:
        """Whether gradient helpers may take some of a step's micro-batches: on CPU only (a
        helper computes on its host, which on a GPU job would be slower than the ranks it
        helps), not at ZeRO-3 (parameters partitioned outside the forward) nor with a KL term
        (a helper holds no reference policy); see ``pivot.actors.gradient_help``."""
        return (
            torch.device(self.engine.device).type == "cpu"
            and self.settings.zero_stage < 3
            and self.settings.kl_coef == 0.0
        )

    def train_step(self, batch: GRPOBatch, rounds: StepRounds | None = None) -> TrainStats:
        """One GRPO step on the whole batch; this rank trains on its share. ``rounds``: which
        of its micro-batches it runs, in what order, and the gradient helpers computed the
        rest (``pivot.actors.gradient_help``); default: all of them, in order."""
        import torch.distributed as dist

        if self._offloaded:
            raise TrainerOffloaded("the trainer's state is offloaded: reload before training")
        started = self.clock()
        s = self.settings
        micro_batches = batch.shard(self.rank, self.world_size).micro_batches(s.micro_batch_size)
        rounds = rounds or InOrder(len(micro_batches))
        denominator = self.denominator(batch)
        lr = float(self.engine.get_lr()[0])
        sums = LossSums()
        while (j := rounds.next_round()) is not None:
            micro = micro_batches[j].to(self.engine.device)
            loss, part = micro_batch_loss(
                self.engine,
                micro,
                s,
                denominator=denominator,
                ref_logprobs=self._reference_logprobs(micro),
            )
            self.engine.backward(loss, scale_wrt_gas=False)
            sums = sums + part
        helped = rounds.helped()
        helped_tokens = 0
        if helped is not None:
            self._fold(helped[0])
            sums = sums + helped[1]
            helped_tokens = int(helped[1].tokens)
        trainer_fault("crash-in-step", self._version + 1, self.rank)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        totals = sums.as_tensor()
        dist.all_reduce(totals)
        sums = LossSums.from_tensor(totals)
        self._version += 1
        return TrainStats(
            version=self._version,
            loss=sums.mean("loss"),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            sequences=batch.size,
            tokens=int(sums.tokens),
            reward_mean=float(batch.rewards.mean()),
            clip_fraction=sums.mean("clipped"),
            ratio_mean=sums.mean("ratio"),
            kl=sums.mean("kl"),
            seconds=self.clock() - started,
            stale_tokens=batch.stale_tokens,
            masked_tokens=batch.masked_tokens,
            helped_tokens=helped_tokens,
        )

    def denominator(self, batch: GRPOBatch) -> float:
        # ranks average their gradients: each divides its token sum by the batch's tokens
        # over the world size, so the average is the gradient of the batch's token mean
        return max(batch.tokens, 1) / self.world_size

    def _fold(self, grads: dict[str, torch.Tensor] | None) -> None:
        """One more backward on every rank, of sum(p * g) with ``g`` the helpers' gradient
        (rank 0) or zero (the others): DeepSpeed reduces it with the ranks' own."""
        named = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
        if grads is None:
            surrogate = sum(p.sum() * 0.0 for _, p in named)  # a zero gradient, no copies
        else:
            surrogate = sum((p * grads[n].to(p.device, p.dtype)).sum() for n, p in named)
        self.engine.backward(surrogate, scale_wrt_gas=False)

    def _reference_logprobs(self, micro: GRPOBatch) -> torch.Tensor | None:
        if self._reference is None:
            return None
        with torch.no_grad():
            logits = self._reference(input_ids=micro.input_ids, use_cache=False).logits
            return token_logprobs(logits, micro.input_ids, self.settings.temperature)

    def offload(self) -> None:
        if self._offloaded:
            return
        self.engine.offload_states(pin_memory=self._pin)
        self._offloaded = True

    def reload(self) -> None:
        if not self._offloaded:
            return
        self.engine.reload_states()
        self._offloaded = False

    def export(self) -> dict[str, torch.Tensor]:
        """The full parameters in checkpoint names (tied ones under both names). ZeRO 1/2:
        views of this rank's live parameters (every rank holds them whole). ZeRO-3: gathered
        copies, a collective every rank must join."""
        if self._offloaded:
            raise TrainerOffloaded("the trainer's state is offloaded: reload before exporting")
        module = self.engine.module
        if self.settings.zero_stage == 3:
            params = list(module.parameters())
            with self._deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {k: v.detach().clone() for k, v in module.state_dict().items()}
        return {k: v.detach() for k, v in module.state_dict().items()}

    def fingerprint(self) -> str:
        """sha256 of the exported parameters (names sorted, raw bytes)."""
        return fingerprint(self.export())


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names and raw bytes, names sorted."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(str(t.dtype).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _read_gps(store: str, into: dict[str, torch.Tensor]) -> int:
    """Copy the version ``store`` publishes into ``into``; returns the version."""
    from pivot.actors.param_store import ParameterReader

    with ParameterReader(store, name="trainer") as reader:
        return reader.read(into)


def published_version(store: str | None) -> int | None:
    """The version the job's GPS store publishes (None: no store, or nothing in it yet)."""
    from pivot.actors.param_store import ParameterReader, StoreError

    if store is None:
        return None
    try:
        with ParameterReader(store, name="trainer") as reader:
            return reader.published_version()
    except StoreError:
        return None


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _warmup_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(warmup_factor, warmup_steps=warmup_steps)
    )


# ---- the rank group: one command, every rank ---------------------------------------------------


@dataclass
class RankCommand:
    """What rank 0 broadcasts. ``kind``: train | publish | offload | reload | fingerprint |
    quit. ``publish``: write the policy to GPS after a train command (every rank must know:
    under ZeRO-3 they all join the gather)."""

    kind: str
    batch: GRPOBatch | None = None
    publish: bool = False
    checkpoint: str = ""  # train: then save a checkpoint into this folder


class _WireCommand(msgspec.Struct, array_like=True):
    kind: str
    publish: bool
    checkpoint: str
    batch: WireBatch | None


_decode_command = msgspec.msgpack.Decoder(_WireCommand).decode


def encode_command(command: RankCommand) -> bytes:
    """``command`` as msgpack bytes (tensors as dtype, shape and raw bytes)."""
    batch = batch_to_wire(command.batch) if command.batch is not None else None
    return msgspec.msgpack.encode(
        _WireCommand(command.kind, command.publish, command.checkpoint, batch)
    )


def decode_command(frame: bytes) -> RankCommand:
    """The ``RankCommand`` that ``encode_command`` made ``frame`` of."""
    wire = _decode_command(frame)
    batch = batch_from_wire(wire.batch) if wire.batch is not None else None
    return RankCommand(wire.kind, batch, wire.publish, wire.checkpoint)


class StepRounds(Protocol):
    """Which micro-batch round a rank runs next in a step (None: no more), and, once none
    is left, the gradient helpers' part to fold in: (gradient or None on ranks other than
    0, loss sums), or None when no helper's gradient came."""

    def next_round(self) -> int | None: ...

    def helped(self) -> tuple[dict[str, torch.Tensor] | None, LossSums] | None: ...


class InOrder:
    """Every round, in order; no helpers."""

    def __init__(self, rounds: int) -> None:
        self._rounds = iter(range(rounds))

    def next_round(self) -> int | None:
        return next(self._rounds, None)

    def helped(self) -> None:
        return None


class BroadcastRounds:
    """Rank 0 names each round from its ``HelpedRounds`` and broadcasts it over the command
    group; the other ranks (``plan`` None) run what it names. The last broadcast says
    whether helpers' gradients are to be folded in (-2) or not (-1)."""

    def __init__(self, group: Any, plan: HelpedRounds | None) -> None:
        self._group = group
        self.plan = plan
        self._helped: tuple[dict[str, torch.Tensor] | None, LossSums] | None = None

    def next_round(self) -> int | None:
        import torch.distributed as dist

        value = torch.zeros(1, dtype=torch.int64)
        if self.plan is not None:
            j = self.plan.next_round()
            while j is None and self.plan.settle():
                j = self.plan.next_round()
            if j is None:
                grads, sums = self.plan.gradients()
                if grads is not None:
                    self._helped = (grads, sums)
                value[0] = -2 if grads is not None else -1
            else:
                value[0] = j
        dist.broadcast(value, src=0, group=self._group)
        j = int(value.item())
        if j == -2 and self.plan is None:
            self._helped = (None, LossSums())
        return j if j >= 0 else None

    def helped(self) -> tuple[dict[str, torch.Tensor] | None, LossSums] | None:
        return self._helped


class RankGroup:
    """Runs commands on every rank of a trainer group: rank 0 ``lead``s (broadcast, then
    run), the other ranks ``follow`` until told to quit. Blocking calls: run them off the
    event loop."""

    def __init__(self, engine: DeepSpeedTrainer, *, store: Any | None = None) -> None:
        import torch.distributed as dist

        self.engine = engine
        self.rank = engine.rank
        self.world_size = engine.world_size
        self.store = store  # a ParameterStore on rank 0, None elsewhere
        # commands travel in a group of their own, with a long timeout: followers wait in
        # it for the next batch
        self._group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self.last_write_s = 0.0
        self.last_checkpoint_s = 0.0
        # rank 0, while a step runs that helpers may join: its rounds (read by the event
        # loop's thread, DeepSpeedBackend.help); and the helpers the last step took
        self.helping: HelpedRounds | None = None
        self.last_helpers: tuple[HelperSpan, ...] = ()

    def _exchange(self, command: RankCommand | None) -> RankCommand:
        import torch.distributed as dist

        # its size, then its bytes: followers wait in the first broadcast for the next one
        frame = encode_command(command) if command is not None else b""
        size = torch.tensor([len(frame)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        if command is not None:
            data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self._group)
        return command if command is not None else decode_command(data.numpy().tobytes())

    def lead(self, command: RankCommand) -> Any:
        if self.rank != 0:
            raise RuntimeError("only rank 0 leads the trainer group")
        return self._run(self._exchange(command))

    def follow(self) -> None:
        if self.rank == 0:
            raise RuntimeError("rank 0 leads the trainer group; it does not follow")
        while True:
            command = self._exchange(None)
            self._run(command)
            if command.kind == "quit":
                return

    def _run(self, command: RankCommand) -> Any:
        import torch.distributed as dist

        engine = self.engine
        if command.kind == "train":
            assert command.batch is not None
            stats = self._train(command)
            # the checkpoint first: a version in GPS is a step done, checkpoint included, so
            # a group that dies before publishing retrains the step, and one that published
            # it has nothing of it to redo
            if command.checkpoint:
                started = time.perf_counter()
                engine.save(Path(command.checkpoint))
                self.last_checkpoint_s = time.perf_counter() - started
            if command.publish:
                self._publish(stats.version)
            return stats
        if command.kind == "publish":
            self._publish(engine.version)
            return None
        if command.kind == "offload":
            engine.offload()
            dist.barrier(group=self._group)
            return None
        if command.kind == "reload":
            engine.reload()
            dist.barrier(group=self._group)
            return None
        if command.kind == "fingerprint":
            mine = torch.frombuffer(bytearray.fromhex(engine.fingerprint()), dtype=torch.uint8)
            digests = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(digests, mine, group=self._group)
            return [d.numpy().tobytes().hex() for d in digests]
        if command.kind == "quit":
            return None
        raise ValueError(f"unknown trainer command {command.kind!r}")

    def _train(self, command: RankCommand) -> TrainStats:
        batch = command.batch
        assert batch is not None
        engine = self.engine
        self.last_helpers = ()
        # helpers only where the step publishes to GPS (they read the policy there): every
        # rank knows it from the command
        if not (command.publish and engine.takes_helpers):
            return engine.train_step(batch)
        plan = None
        if self.rank == 0:
            size = engine.settings.micro_batch_size
            plan = HelpedRounds(
                [
                    batch.shard(r, self.world_size).micro_batches(size)
                    for r in range(self.world_size)
                ],
                denominator=engine.denominator(batch),
            )
            self.helping = plan
        try:
            return engine.train_step(batch, BroadcastRounds(self._group, plan))
        finally:
            if plan is not None:
                self.helping = None
                self.last_helpers = plan.spans()

    def _publish(self, version: int) -> None:
        """Write the policy to GPS as ``version`` (rank 0 writes; under ZeRO-3 every rank
        joins the gather)."""
        if self.store is None and self.engine.zero_stage != 3:
            return  # ZeRO 1/2: nothing to gather, nothing to write on this rank
        tensors = self.engine.export()
        if self.store is not None:
            started = time.perf_counter()
            self.store.write(tensors, version=version)
            self.last_write_s = time.perf_counter() - started


# ---- the backend on rank 0 ---------------------------------------------------------------------


class DeepSpeedBackend:
    """``TrainingBackend`` (``pivot.actors.trainer``) on rank 0 of a trainer group: each
    command runs on every rank (``RankGroup.lead``, off the event loop). After a command
    failed the ranks may disagree: every later one is refused, and ``close`` does not ask
    the others to quit (their supervisor stops them)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.engine = group.engine
        self._failed: BaseException | None = None
        self._helping: set[asyncio.Task[None]] = set()  # requests to helpers in flight

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_stage

    @property
    def store(self) -> str | None:
        return self.group.store.name if self.group.store is not None else None

    async def _lead(self, command: RankCommand) -> Any:
        if self._failed is not None:
            raise RuntimeError(f"trainer group failed earlier: {self._failed!r}")
        try:
            return await asyncio.to_thread(self.group.lead, command)
        except Exception as exc:
            self._failed = exc
            raise

    async def start(self) -> None:
        store = self.group.store
        if store is not None and store.version != self.engine.version:
            # the version it starts at (0, the checkpoint): a replica that shifts up before the
            # first step reads it; a restarted group finds its version published already
            await self._lead(RankCommand("publish"))

    async def prepare(self, msg: TrainBatch | SimTrainBatch) -> RankCommand:
        if not isinstance(msg, TrainBatch):
            raise TypeError(f"a DeepSpeed trainer takes TrainBatch, not {type(msg).__name__}")
        engine = self.engine
        batch = build_batch(
            msg.samples,
            pad_id=engine.pad_id,
            advantage_eps=engine.settings.advantage_eps,
            vocab_size=engine.config.vocab_size,
            max_len=engine.config.max_position_embeddings,
            version=engine.version,  # the trainer checked it is the batch's, when it names one
            max_staleness=msg.max_staleness,
        )
        publish = self.group.store is not None
        return RankCommand("train", batch, publish=publish, checkpoint=msg.checkpoint)

    async def train(self, command: RankCommand) -> TrainResult:
        stats: TrainStats = await self._lead(command)
        return TrainResult(
            stats=stats,
            gps_version=stats.version if command.publish else None,
            gps_write_s=self.group.last_write_s if command.publish else 0.0,
            checkpoint_s=self.group.last_checkpoint_s if command.checkpoint else 0.0,
            helpers=self.group.last_helpers,
        )

    @property
    def takes_helpers(self) -> bool:
        return self.engine.takes_helpers and self.group.store is not None

    async def help(self, helpers: list[GradientHelper], ask: AskHelper) -> list[str]:
        plan = self.group.helping
        store = self.store
        if plan is None or store is None:
            return []
        engine = self.engine
        taken = []
        for helper in helpers:
            rounds = plan.claim(helper.replica, helper.devices)
            if not rounds:
                continue
            request = ComputeGradients(
                version=engine.version,
                store=store,
                policy=engine.checkpoint,
                batches=[batch_to_wire(b) for b in plan.batches(rounds)],
                denominator=plan.denominator,
                settings=engine.settings,
            )
            task = asyncio.create_task(self._helped(plan, helper, request, ask))
            self._helping.add(task)
            task.add_done_callback(self._helping.discard)
            taken.append(helper.replica)
        return taken

    async def _helped(
        self, plan: HelpedRounds, helper: GradientHelper, request: ComputeGradients, ask: AskHelper
    ) -> None:
        try:
            reply = await ask(agent_name(helper.devices[0]), request)
            if reply.stale:
                raise RuntimeError(f"{helper.replica} read a newer policy than the step's")
        except Exception as exc:  # noqa: BLE001 - the ranks run its rounds instead
            plan.deliver(helper.replica, None, exc)
        else:
            plan.deliver(helper.replica, reply)

    async def offload(self) -> float:
        started = time.perf_counter()
        await self._lead(RankCommand("offload"))
        return time.perf_counter() - started

    async def reload(self) -> float:
        started = time.perf_counter()
        await self._lead(RankCommand("reload"))
        return time.perf_counter() - started

    async def fingerprints(self) -> list[str]:
        return await self._lead(RankCommand("fingerprint"))

    async def close(self) -> None:
        try:
            if self._failed is None:
                # bounded: a follower that died leaves rank 0 waiting in the broadcast
                async with asyncio.timeout(30.0):
                    await asyncio.to_thread(self.group.lead, RankCommand("quit"))
        finally:
            if self.group.store is not None:
                self.group.store.close()


# ---- the other ranks ---------------------------------------------------------------------------


class TrainerFollower(Actor):
    """Rank r > 0 of a trainer group: runs what rank 0 broadcasts until told to quit, then
    stops (its process exits 0). Answers only Ping on the bus."""

    def __init__(self, name: str, bus: Bus, *, group: RankGroup) -> None:
        super().__init__(name, bus)
        self.group = group

    async def run(self) -> None:
        # a daemon thread, not the default executor: a follower stopped while it waits in a
        # collective must not hold its process's exit on that thread
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if done.done():
                return
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

        def follow() -> None:
            try:
                self.group.follow()
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, exc)
            else:
                loop.call_soon_threadsafe(settle, None)

        threading.Thread(target=follow, name=f"{self.name}:follow", daemon=True).start()
        await done
        self.log.info("rank 0 said quit")
        await self.stop()


# ---- processes --------------------------------------------------------------------------------


def trainer_rank(
    name: str,
    *,
    directory: dict[str, Any],
    checkpoint: str,
    rank: int,
    world_size: int,
    rendezvous: str,
    store_name: str | None = None,
    settings: dict[str, Any] | None = None,
    threads: int = 1,
    controller: str | None = None,
    resume: str | None = None,
    checkpoints: str | None = None,
    accelerator: str = "cpu",
    gpu: int | None = None,
    dtype: str = "float32",
    cores: list[int] | None = None,
) -> Actor:
    """Factory for ``Supervisor.add_process``: rank ``rank`` of a trainer group training the
    Hugging Face checkpoint ``checkpoint`` (on ``accelerator``; on CUDA on GPU ``gpu``, in
    ``dtype``; on ``cores`` when pinned). Rank 0 returns the ``Trainer`` (and, with
    ``store_name``, creates the GPS store of that name and writes every version there);
    the others return a ``TrainerFollower``. ``settings``: a ``TrainingSettings`` as a dict.
    ``controller``: the actor to tell when a batch waits for the lent pool (see ``Trainer``)."""
    # a supervised child's first stdout line must be its READY; DeepSpeed and transformers
    # print while they import and initialise
    with stdout_to_stderr():
        return _trainer_rank(
            name,
            directory=directory,
            checkpoint=checkpoint,
            rank=rank,
            world_size=world_size,
            rendezvous=rendezvous,
            store_name=store_name,
            settings=settings,
            threads=threads,
            controller=controller,
            resume=resume,
            checkpoints=checkpoints,
            accelerator=accelerator,
            gpu=gpu,
            dtype=dtype,
            cores=cores,
        )


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 (and ``sys.stdout``) at stderr for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _trainer_rank(
    name: str,
    *,
    directory: dict[str, Any],
    checkpoint: str,
    rank: int,
    world_size: int,
    rendezvous: str,
    store_name: str | None,
    settings: dict[str, Any] | None,
    threads: int,
    controller: str | None,
    resume: str | None,
    checkpoints: str | None,
    accelerator: str,
    gpu: int | None,
    dtype: str,
    cores: list[int] | None = None,
) -> Actor:
    from pivot.accelerator import dist_backend

    if cores:  # this rank's device's share of the host's cores
        from pivot.actors.processes import pin_to_cores

        pin_to_cores(cores)
    torch.set_num_threads(threads)
    training = convert(settings or {}, TrainingSettings, "trainer settings")
    if accelerator == "cuda":  # before the group: NCCL binds each rank to the current device
        torch.cuda.set_device(gpu or 0)
    # each start of the group meets afresh: a killed group leaves its rendezvous file behind
    init_process_group(
        rank,
        world_size,
        f"{rendezvous}.{os.environ.get(START_ENV, '0')}",
        backend=dist_backend(accelerator),
        gpu=(gpu or 0) if accelerator == "cuda" else None,
    )
    start = _choose_start(rank, checkpoint, resume, store_name, checkpoints)
    engine = DeepSpeedTrainer(
        start.policy,
        training,
        resume=start.trainer,
        gps=store_name if start.source == "gps" else None,
        bf16=dtype == "bfloat16",
    )
    store = None
    if rank == 0 and store_name is not None:
        from pivot.actors.param_store import ParameterStore

        # the job's: it outlives this process, and a restarted rank 0 takes it over
        store = ParameterStore(store_name, adopt=True)
    group = RankGroup(engine, store=store)
    bus = Bus.nng(Directory.from_dict(directory), rl_messages(), secret=job_secret())
    if rank == 0:
        restarted = None
        if not first_start():
            restarted = TrainerRestart(
                source=start.source,
                version=start.version,
                checkpoint=start.checkpoint,
                exact=start.exact,
            )
        return Trainer(
            name, bus, backend=DeepSpeedBackend(group), controller=controller, restarted=restarted
        )
    return TrainerFollower(name, bus, group=group)


def _choose_start(
    rank: int,
    checkpoint: str,
    resume: str | None,
    store: str | None,
    checkpoints: str | None,
) -> TrainerStart:
    """Where this group starts (``trainer_start``): rank 0 chooses and leaves its choice in
    the rendezvous store, the other ranks take it from there, so that a checkpoint committed
    while they look cannot split them."""
    import torch.distributed as dist

    kv = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the rendezvous's own
    if rank != 0:
        return msgspec.json.decode(kv.get(_START_KEY), type=TrainerStart)
    version = read_checkpoint(Path(resume).parent).state.policy_version if resume else 0
    start = TrainerStart(source="start", version=version, policy=checkpoint, trainer=resume)
    latest = Checkpoints(Path(checkpoints)).latest() if checkpoints else None
    chosen = trainer_start(start, published_version(store), latest)
    kv.set(_START_KEY, msgspec.json.encode(chosen))
    return chosen


def trainer_group(
    name: str,
    *,
    directory: Directory | Mapping[str, Any],
    checkpoint: str | Path,
    world_size: int,
    run_dir: str | Path,
    store_name: str | None = None,
    settings: TrainingSettings | None = None,
    threads: int = 1,
    controller: str | None = None,
    policy: RestartPolicy | None = None,
    ready_timeout: float = 600.0,
    resume: str | Path | None = None,
    checkpoints: str | Path | None = None,
    accelerator: str = "cpu",
    gpus: Sequence[int] | None = None,
    dtype: str = "float32",
    cores: Sequence[Sequence[int] | None] | None = None,
) -> list[tuple[str, ChildProcess]]:
    """The child processes of every rank of a trainer group, by actor name (``trainer_names``,
    each of which ``directory`` must hold), in the order to supervise them.

    Ranks meet through a file in ``run_dir``, one per start of the group (no TCP port to
    pick; stale ones from an earlier run are removed). They are one supervised group, named
    ``name`` (a rank that dies takes the others down and all start again: a gloo group cannot
    lose a rank), started together, rank 0 added last so that it stops first and tells the
    others to quit. ``controller``: see ``Trainer`` (None: a batch that finds the pool lent
    reloads at once). ``policy``: the group's restart policy, by default none: a crash stops
    the job. ``ready_timeout`` covers imports, the rendezvous and loading the model (plus the
    FusedAdam JIT build at ZeRO-3 the first time). ``resume``: a checkpoint's ``trainer/``
    folder (``DeepSpeedTrainer.save``) whose optimizer state and version the group continues
    from; ``checkpoint`` is then that checkpoint's ``policy/``. ``checkpoints``: the run's
    checkpoints folder, where a restarted group looks for the last complete one.
    ``accelerator``: ``cpu``, or ``cuda`` with rank r on GPU ``gpus[r]`` (default: GPU r), in
    ``dtype`` (``model.dtype``). ``cores``: per rank, the CPU cores it is pinned to (None:
    not pinned).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, found {world_size}")
    names = trainer_names(name, world_size)
    entries = directory.to_dict() if isinstance(directory, Directory) else dict(directory)
    missing = [n for n in names if n not in entries]
    if missing:
        raise ValueError(f"the directory has no entry for trainer ranks {missing}")
    rendezvous = Path(run_dir).absolute() / f"{name}.rendezvous"
    rendezvous.parent.mkdir(parents=True, exist_ok=True)
    for stale in rendezvous.parent.glob(f"{rendezvous.name}*"):
        stale.unlink(missing_ok=True)
    settings_dict = _settings_dict(settings or TrainingSettings())
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return [
        (
            names[rank],
            ChildProcess(
                target="pivot.actors.trainer_deepspeed:trainer_rank",
                kwargs={
                    "directory": entries,
                    "checkpoint": str(Path(checkpoint).absolute()),
                    "rank": rank,
                    "world_size": world_size,
                    "rendezvous": f"file://{rendezvous}",
                    # rank 0 writes it; every rank may restart from the version it publishes
                    "store_name": store_name,
                    "settings": settings_dict,
                    "threads": threads,
                    "controller": controller if rank == 0 else None,
                    "resume": str(Path(resume).absolute()) if resume is not None else None,
                    "checkpoints": str(Path(checkpoints).absolute()) if checkpoints else None,
                    "accelerator": accelerator,
                    "gpu": (list(gpus)[rank] if gpus else rank) if accelerator == "cuda" else None,
                    "dtype": dtype,
                    "cores": list(cores[rank]) if cores and cores[rank] else None,
                },
                env=env,
                ready_timeout=ready_timeout,
                policy=policy or RestartPolicy(restart="never"),
                stop_timeout=15.0,
                group=name,
            ),
        )
        for rank in [*range(1, world_size), 0]
    ]


def add_trainer_group(supervisor: Supervisor, name: str, **group: Any) -> list[str]:
    """Supervise every rank of ``trainer_group(name, **group)``; returns their names."""
    ranks = trainer_group(name, **group)
    for rank_name, child in ranks:
        child.add_to(supervisor, rank_name)
    return trainer_names(name, len(ranks))


def _settings_dict(settings: TrainingSettings) -> dict[str, Any]:
    return msgspec.to_builtins(settings)
