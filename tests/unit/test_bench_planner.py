"""The planner bench runs, gives the planner real work, and prints the paper's numbers beside."""

from pivot.cli.bench_planner import format_table, run_bench


def test_bench_reports_every_phase_per_size_on_snapshots_with_work_to_do():
    result = run_bench(sizes=(16, 64), repeats=2, seed=1)
    assert set(result["sizes"]) == {"16", "64"}
    for row in result["sizes"].values():
        for phase in ("preprocess", "construction", "simulation", "total"):
            assert row[f"{phase}_ms_mean"] >= 0.0 and row[f"{phase}_ms_std"] >= 0.0
        assert row["total_ms_mean"] >= row["simulation_ms_mean"]
        assert row["candidates_mean"] >= 1  # no trivial early exits
        assert row["sequences_mean"] > 100
    table = format_table(result)
    assert "0.31 ± 0.27" in table and "1.71 ± 1.17" in table  # the paper's 16 and 64 rows
    assert len(table.splitlines()) == 4
