#!/usr/bin/env python3
"""plot.py's readings of a results folder, checked: run labels from the swept values, when a
latency axis turns logarithmic, the waste bars against the summary's own figure, and the
preemption markers against the run's count.

    python3 tests/experiments/test_plot.py [RESULTS_FOLDER]   (the folder: checks a real run)
"""
import importlib.util
import json
import pathlib
import sys
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot", ROOT / "experiments" / "plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)
RESULTS = pathlib.Path(sys.argv.pop(1)) if len(sys.argv) > 1 else None


class Labels(unittest.TestCase):
    def test_only_the_keys_that_vary_name_a_run(self):
        swept = [{"scheduler.name": "fcfs", "scheduler.params": {"max_batch": 32, "preemption": "recompute"}},
                 {"scheduler.name": "fcfs", "scheduler.params": {"max_batch": 32, "preemption": "swap"}},
                 {"scheduler.name": "priority", "scheduler.params": {"max_batch": 32, "preemption": "swap"}}]
        self.assertEqual(plot.readable_labels(swept),
                         ["fcfs, preemption=recompute", "fcfs, preemption=swap", "priority, preemption=swap"])

    def test_a_load_axis_is_left_out_of_the_series(self):
        swept = [{"scheduler.name": n, "workload.azure_trace.rate_scale": r}
                 for n in ("static", "fcfs") for r in (1.0, 2.5)]
        self.assertEqual(plot.readable_labels(swept), ["static, rate_scale=1", "static, rate_scale=2.5",
                                                       "fcfs, rate_scale=1", "fcfs, rate_scale=2.5"])
        self.assertEqual(plot.readable_labels(swept, leave_out=("workload.azure_trace.rate_scale",)),
                         ["static", "static", "fcfs", "fcfs"])
        self.assertEqual(plot.readable_labels([{}]), ["(base)"])


class Axes(unittest.TestCase):
    def test_log_scale_only_across_decades(self):
        self.assertTrue(plot.spans_decades([0.01, 0.5, 2.0]))
        self.assertFalse(plot.spans_decades([0.5, 2.0, 4.9]))
        self.assertFalse(plot.spans_decades([0.0, 3.0]))


class Waste(unittest.TestCase):
    def test_parts_over_held_slots(self):
        steps = [{"kv_used": "60", "kv_reserved_unused": "30", "kv_last_block_slack": "10", "padding_slots": "20"},
                 {"kv_used": "100", "kv_reserved_unused": "0", "kv_last_block_slack": "0", "padding_slots": "0"}]
        self.assertEqual(plot.waste_of_held(steps),
                         {"reserved unused": 0.15, "last-block slack": 0.05, "padding": 0.1})


@unittest.skipIf(RESULTS is None, "no results folder given")
class RealRun(unittest.TestCase):
    def test_bars_are_the_tables_waste_and_markers_the_runs_preemptions(self):
        runs, _ = plot.load(RESULTS)
        self.assertEqual(len({run["colour"] for run in runs}), len({run["series"] for run in runs}))
        for run in runs:
            shown = sum(plot.waste_of_held(run["steps"]).values())
            self.assertAlmostEqual(shown, run["summary"]["kv_waste_of_held_fraction"], places=6)
            recompute, swap = plot.preemption_times(run)
            self.assertEqual(len(recompute) + len(swap), run["summary"]["preemptions"], run["label"])
        self.assertTrue(any(plot.preemption_times(run)[1] for run in runs), "no swap in the run")
        for png in ("throughput_latency", "latency_cdf", "kv_usage", "kv_waste"):
            self.assertGreater((RESULTS / "plots" / f"{png}.png").stat().st_size, 1000, png)


if __name__ == "__main__":
    unittest.main()
