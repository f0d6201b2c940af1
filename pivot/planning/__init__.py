"""Deciding shifts: cluster snapshots (``snapshot``), decode cost models (``cost``), the shared
waiting queue (``queue``), routing (``routing``), the planner's candidates, request-level
evaluation and five steps (``candidates``, ``evaluation``, ``planner``), the plans it emits
(``plans``), the time-sharing baselines' stage policy (``staging``) and synthetic clusters and
snapshots to run it on (``scenarios``). Pure and torch-free."""
