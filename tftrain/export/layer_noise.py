"""How much noise a layer of an int8 artifact may add (`fidelity`'s rows): no more than
its own 8-bit tensors allow, and no more than `export.min_layer_sqnr` unless that is all
its tensors allow."""
from __future__ import annotations

# a layer may add this much more noise than its own 8-bit tensors allow
# (`allowed_sqnr_db`). Measured on --smoke runs (2026-12-04) of post-training int8
# files of a CNN, a ResNet, MobileNetV2, MobileNetV3Small and EfficientNetB0 (TFLite,
# and ONNX for the CNN and EfficientNetB0): at most LEEWAY_MEASURED_DB beyond it (a
# MobileNetV3Small hard-swish, whose `x / 6` LiteRT's calibration then held on the
# product's range, now measured on its own values by `calibration`; a squeeze-excite mean
# 6.3 dB, others 4.4 dB at most); QAT files' layers add less than
# their steps allow (they were trained with that rounding). A kernel 5% off adds noise
# about 26 dB down, wherever its steps allow 40 or more
LEEWAY_DB, LEEWAY_MEASURED_DB = 10.0, 8.5

# a float16 file's layer (weights rounded to 11 bits, computed in float32) adds noise far
# below an 8-bit one's: 10 log10(3 x 2^22) = 71 dB for a value's own rounding
FLOAT16_FLOOR_DB = 50.0


def floor(precision: str, cfg) -> float:
    """The SQNR (dB) a layer of a file of `precision` must keep above the noise it adds:
    `export.min_layer_sqnr` for 8-bit kernels (int8, dynamic range), `FLOAT16_FLOOR_DB`
    for float16."""
    return FLOAT16_FLOOR_DB if precision == "float16" else cfg.min_layer_sqnr


# a range is the values' own when they reach at least this share of one of its ends (a
# range calibrated on them, wide for a few large values); a range 8 times too wide, 1/8
RANGE_FILL = 0.5


def rounding_limited(row: dict) -> bool:
    """Whether a layer's noise is what its own 8-bit tensors allow (within `LEEWAY_DB`)
    and either its output's range is its values' (`RANGE_FILL`: a range calibrated on a
    few large values rounds the rest coarsely, as an untrained squeeze-excite gate's
    input), or its values are smaller than one 8-bit step (a gate nearly closed on every
    example: the file rounds it to zero), and its ranges clip less than `SATURATED` of its
    values: the 8-bit file cannot do better, and no conversion fault does that."""
    allowed = row.get("allowed_sqnr_db")
    return (allowed is not None and row["local_sqnr_db"] >= allowed - LEEWAY_DB and (
        row.get("range_fill", 0.0) >= RANGE_FILL or row.get("signal_steps", 1.0) < 1.0)) \
        and not clips(row)


# a layer's 8-bit tensors clipping this share of their values: named in the reason (a
# range narrower than the values it is fed, however they came, is never excused: an
# exemption for clipping after amplified inputs was added for one smoke-trained Keras 3
# MobileNetV3Small, whose clipping was LiteRT's int8 ADD into relu6 at a scale ratio of
# 423, fixed in the conversion; with it, a range 1/8 too narrow passed as well)
SATURATED = 0.01


def clips(row: dict) -> bool:
    """Whether a layer's 8-bit ranges clip at least `SATURATED` of its values."""
    return row.get("saturated", 0.0) >= SATURATED


def too_noisy(row: dict, floor: float) -> bool:
    """Whether a layer the file computes in one op adds more noise than its own 8-bit
    tensors allow (`LEEWAY_DB` beyond `allowed_sqnr_db`: the estimate does not see the
    rounding inside an attention or a token mean, whose layers reached 12-14 dB beyond
    it), or any layer more than `floor` dB below its values
    (`export.min_layer_sqnr`) where it is not `rounding_limited`."""
    local = row["local_sqnr_db"]
    if row.get("tensors", 1) == 1 and local < row.get("allowed_sqnr_db", float("-inf")) - LEEWAY_DB:
        return True      # a layer the file computes in one op (composites: the floor alone)
    return local < floor and not rounding_limited(row)


def why_noisy(row: dict, floor: float, precision: str = "int8") -> str:
    """What a layer's noise is held to, and whether it is within it."""
    local, allowed = row["local_sqnr_db"], row.get("allowed_sqnr_db")
    named = "float16's layer floor" if precision == "float16" else "export.min_layer_sqnr"
    said = (f"{row['layer']}, adds noise {local:.1f} dB below its values "
            f"{'>=' if local >= floor else '<'} {named} {floor:g}")
    if allowed is None:
        return said
    ok = local >= allowed - LEEWAY_DB
    said += (f", {'within' if ok else 'beyond'} {LEEWAY_DB:g} dB of the {allowed:.1f} dB "
             "its own 8-bit steps allow")
    if clips(row):
        fed = (f", fed inputs {row['input_sqnr_db']:.1f} dB from the model's"
               if "input_sqnr_db" in row else "")
        return said + (f"; its 8-bit ranges clip {row['saturated']:.1%} of its values{fed} "
                       "(a range narrower than what the file computes there)")
    if local >= floor or not ok:
        return said
    fill = row.get("range_fill", 0.0)
    if fill < RANGE_FILL and row.get("signal_steps", 1.0) < 1.0:
        return said + (f"; its values are {row['signal_steps']:.2f} of an 8-bit step (RMS): "
                       "rounding-limited, the 8-bit file rounds them to the nearest step")
    return said + (f"; its values reach {fill:.0%} of its 8-bit range's end "
                   + ("(rounding-limited: the range is its values', the 8-bit file can do no "
                      "better; calibrate on more examples or train with QAT)"
                      if fill >= RANGE_FILL else
                      f"(below {RANGE_FILL:.0%}: the range is wider than its values)"))
