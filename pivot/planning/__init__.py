"""Deciding shifts: cluster snapshots (``snapshot``), decode cost models (``cost``), the shared
waiting queue (``queue``), routing (``routing``), the planner's candidates, request-level
evaluation and five steps (``candidates``, ``evaluation``, ``planner``), the plans it emits
(``plans``) and the time-sharing baselines' stage policy (``staging``). Pure and torch-free."""
