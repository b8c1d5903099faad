"""report.html: drawn from a run directory, rendered by a real browser (Debian's
chromium, headless), every chart present and drawn."""
from __future__ import annotations

import csv
import json


from helpers import blue_pixels, charts_drawn, render
from tftrain.training import report_page

def write_run(path, with_int8=True):
    """A small run directory as a run leaves it (summary.json and the CSV logs)."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "updates.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["update", "loss", "accuracy", "lr"])
        for u in range(1, 21):
            w.writerow([u, 2.0 / u, 1 - 1.0 / (u + 1), 0.001])
    with open(path / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "accuracy", "loss", "val_accuracy", "val_loss", "lr"])
        for e in range(4):
            w.writerow([e, 0.5 + 0.1 * e, 1.0 - 0.2 * e, 0.55 + 0.1 * e, 0.9 - 0.2 * e, 0.001])
    layers = [{"layer": f"l{i}", "sqnr_db": 40.0 - i, "local_sqnr_db": 45.0 - i, "op": "CONV_2D"}
              for i in range(6)]
    artifacts = {"saved_model": {"size_bytes": 200_000, "gzip_bytes": 150_000, "accuracy": 0.91,
                                 "latency_ms": 0.5, "verified": True, "check": "ok",
                                 "path": "export/saved_model/"}}
    if with_int8:
        artifacts["tflite_int8"] = {"size_bytes": 60_000, "gzip_bytes": 50_000, "accuracy": 0.9,
                                    "latency_grid": {"batch1_threads1": 0.01}, "layers": layers,
                                    "verified": True, "check": "ok",
                                    "path": "export/model.tflite"}
    summary = {"status": "completed", "strategy": "mirrored", "replicas": 2, "workers": 1,
               "devices": ["CPU:0", "CPU:1"], "precision": "float32", "steps": 20, "epochs": 4,
               "per_replica_batch_size": 32, "accumulation_steps": 1, "global_batch_size": 64,
               "throughput": {"examples_per_sec": 5000.0}, "metrics": {"val_accuracy": 0.91},
               "stages": {"train": {"metrics": {"val_accuracy": 0.91}, "updates": 20}},
               "confusion": [[5, 1, 0], [0, 6, 1], [1, 0, 7]], "artifacts": artifacts,
               "memory_plan": {"kind": "data", "stages": 1, "device_memory": 2**34,
                               "bytes_per_device": [2 * 2**20]}}
    (path / "summary.json").write_text(json.dumps(summary))
    return summary


def test_a_report_is_one_self_contained_page_of_every_chart(tmp_path):
    write_run(tmp_path / "run")
    page = report_page.write(tmp_path / "run")
    text = page.read_text()
    from html.parser import HTMLParser

    class Sources(HTMLParser):
        found: list = []

        def handle_starttag(self, tag, attrs):
            if tag in ("script", "link", "img") and any(k in ("src", "href") for k, _ in attrs):
                self.found.append((tag, attrs))
    sources = Sources()
    sources.feed(text)
    assert sources.found == []                  # nothing fetched: the script is inlined
    assert text.count('<div id="chart-') == 6                # no search: its chart is left out
    assert "tflite_int8" in text and "export/model.tflite" in text
    assert "data parallel, 1 stage(s): 2.0 MiB per device of 16.0 GiB" in text
    # a compression search of the run adds its chart (search/search.json)
    (tmp_path / "run" / "search").mkdir()
    figures = lambda acc, ms, size: {"accuracy": acc, "latency_ms": ms, "bytes": size,  # noqa: E731
                                     "latency_ratio": ms / 0.2, "drop": 0.95 - acc}
    record = {"target": {"max_accuracy_drop": 0.01, "max_latency_ratio": 0.5,
                         "latency": {"runtime": "tflite", "batch": 1, "threads": 1}},
              "dense": figures(0.95, 0.2, 200_000), "front": ["float", "channels50-qat"],
              "chosen": "channels50-qat",
              "candidates": {"float": {"figures": figures(0.95, 0.2, 200_000)},
                             "int8": {"figures": figures(0.93, 0.12, 60_000)},
                             "channels50-qat": {"figures": figures(0.945, 0.08, 30_000)},
                             "channels25-float": {"status": "refused"}}}
    (tmp_path / "run" / "search" / "search.json").write_text(json.dumps(record))
    text = report_page.write(tmp_path / "run").read_text()
    assert text.count('<div id="chart-') == 7 and '<div id="chart-6"' in text
    assert "channels50-qat" in text and "accuracy floor" in text and "latency limit" in text


def test_the_browser_draws_every_chart(tmp_path):
    write_run(tmp_path / "run")
    dom, image = render(report_page.write(tmp_path / "run"), tmp_path)
    drawn = charts_drawn(dom)
    assert len(drawn) == 6 and all(n > 0 for n in drawn.values()), drawn
    assert blue_pixels(image) > 2000                 # traces on the screenshot, not a blank page
    # and without an int8 artifact, no SQNR chart
    write_run(tmp_path / "plain", with_int8=False)
    assert report_page.write(tmp_path / "plain").read_text().count('<div id="chart-') == 5
