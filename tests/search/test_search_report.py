"""What a search prints: its table of candidates."""
from types import SimpleNamespace

from tftrain.search import report


def test_the_table_says_gain_or_loss_and_keeps_its_columns_aligned(tmp_path):
    """A candidate 5.56 points better than the dense model reads `+5.56 pt` (it read
    `-5.56 pt`, a drop), one 0.40 worse `-0.40 pt`; every column lines up whatever the
    width of its cells."""
    def figures(accuracy, drop, size, ms, ratio, borderline=False):
        return {"accuracy": accuracy, "drop": drop, "bytes": size, "latency_ms": ms,
                "latency_ratio": ratio, "latency_rounds": [ratio] * 5,
                "latency_interval": [ratio * 0.9, ratio * 1.08], "borderline": borderline,
                "label": "int8"}
    record = {"candidates": {
        "float": {"status": "done", "figures": figures(0.9185, 0.0, 1_234_567, 0.0541, 1.0)},
        "channels50-qat": {"status": "done", "figures": figures(0.9741, -0.0556, 334_000, 0.027, 0.5)},
        "int8": {"status": "done", "figures": figures(0.9145, 0.0040, 98_000, 0.0312, 0.577,
                                                      borderline=True)},
        "channels70-qat": {"status": "refused", "reason": "no group"}},
        "front": ["channels50-qat"]}
    target = SimpleNamespace(max_accuracy_drop=0.01, max_bytes=None, max_latency_ms=None,
                             max_latency_ratio=0.55)
    rows = report.rows(SimpleNamespace(record=record, target=target))
    table = report._aligned([("candidate", "accuracy", "change", "size", "ms", "vs dense",
                              "interval", "status")]
                            + [report._cells(r) for r in rows])
    line = {text.split()[0]: text for text in table}
    assert line["channels50-qat"].split()[2:4] == ["+5.56", "pt"]
    assert line["int8"].split()[2:4] == ["-0.40", "pt"]
    assert line["channels50-qat"].endswith("meets (front)")
    assert line["int8"].endswith("misses (borderline)")            # the interval straddles 0.55
    assert "0.52-0.62x, 5 rounds" in line["int8"] and "0.45-0.54x, 5 rounds" in line["channels50-qat"]
    for column in ("accuracy", "change", "vs dense", "interval"):      # right edges line up
        end = line["candidate"].index(column) + len(column)
        assert {text[end - 1] for text in table[2:4]} <= set("0123456789tsx"), (column, table)
    assert len({text.index(" pt") for text in table if " pt" in text}) == 1
    assert len({len(text.rsplit("  ", 1)[0]) for text in table}) == 1        # status column
