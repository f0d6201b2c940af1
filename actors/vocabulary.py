"""The job's vocabulary: every message the actors exchange, listed (one tagged union: the
codec is built from ``MESSAGES``, never discovered by walking subclasses, so what a process
can decode does not depend on what it happened to import), and the pub/sub topics.

Whatever must arrive travels as a request (``messages``, ``shift_messages``,
``trainer_messages``); only what the next sample replaces is published, on these topics:

* ``LOAD_TOPIC``: agents' ``ReplicaLoad`` after each step (routing, the planner's refit);
* ``SEGMENTS_TOPIC``: agents' ``EngineSegments`` about once a second (a real job's account);
* ``SHIFT_TOPIC``: the Controller's ``ShiftStarted``, ``ShiftFinished``, ``AllocationChanged``;
* ``SHIFT_TOPIC`` also carries its ``PlannerDecided`` (rate-limited);
* ``TRAINER_TOPIC``: the trainer's ``TrainerState`` on each change of state;
* ``EVENTS_TOPIC``: the Monitor's ``EventBatch`` each interval (``pivot.events``, watchers).
"""

from __future__ import annotations

from pivot.actors import messages as rl
from pivot.actors import shift_messages as shift
from pivot.actors import trainer_messages as trainer
from pivot.actors.messages import RLMessage

LOAD_TOPIC = "load"
SEGMENTS_TOPIC = "segments"
SHIFT_TOPIC = "shift"
TRAINER_TOPIC = "trainer"
EVENTS_TOPIC = "events"

MESSAGES: tuple[type[RLMessage], ...] = (
    # driver <-> schedulers <-> agents
    rl.SubmitSequences,
    rl.Accepted,
    rl.Completed,
    rl.QueryStatus,
    rl.SchedulerStatus,
    rl.EndSession,
    rl.RegisterReplica,
    rl.Assign,
    rl.Finished,
    rl.Abort,
    rl.Aborted,
    rl.Ack,
    rl.ReplicaLoad,
    rl.EngineSegments,
    # a process attached to the job
    rl.GenerateRequest,
    rl.GenerateReply,
    rl.SubmitTrajectories,
    rl.StopJob,
    rl.StopAccepted,
    # the job's events, for watchers
    rl.EventBatch,
    rl.QueryEvents,
    rl.EventSnapshot,
    # the Controller's shifts
    shift.CutRouting,
    shift.RestoreRouting,
    shift.RegisterReplicas,
    shift.RemoveReplica,
    shift.ReplicaRemoved,
    shift.MigrateSequences,
    shift.QueryLoad,
    shift.RoleLoadReport,
    shift.Evacuate,
    shift.Evacuated,
    shift.Describe,
    shift.Release,
    shift.Acquire,
    shift.Register,
    shift.AgentState,
    shift.TrainerPhaseChanged,
    shift.BatchForecast,
    shift.AgentLost,
    shift.AgentJoined,
    shift.QueryAllocation,
    shift.AllocationReport,
    shift.ShiftStarted,
    shift.ShiftFinished,
    shift.AllocationChanged,
    shift.PlannerDecided,
    # the trainer
    trainer.TrainBatch,
    trainer.SimTrainBatch,
    trainer.Trained,
    trainer.OffloadTrainer,
    trainer.ReloadTrainer,
    trainer.QueryTrainer,
    trainer.TrainerStatus,
    trainer.TrainerState,
    trainer.HelpTrainer,
    trainer.Helping,
    trainer.HelpEnded,
    trainer.ComputeGradients,
    trainer.HelperGradients,
)


def rl_messages() -> list[type[RLMessage]]:
    """The message types a job's bus is built with."""
    return list(MESSAGES)
