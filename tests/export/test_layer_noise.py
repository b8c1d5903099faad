"""How much noise an int8 layer may add: its own steps' allowance, the floor, and the
rounding-limited layers below it."""
from tftrain.export import layer_noise


def row(local, allowed=None, fill=None):
    found = {"layer": "conv", "local_sqnr_db": local}
    if allowed is not None:
        found["allowed_sqnr_db"] = allowed
    if fill is not None:
        found["range_fill"] = fill
    return found


def test_a_layer_fails_beyond_its_steps_or_below_the_floor_unless_rounding_limited():
    floor, leeway = 20.0, layer_noise.LEEWAY_DB
    assert not layer_noise.too_noisy(row(45.0), floor)              # no step known: the floor
    assert layer_noise.too_noisy(row(19.9), floor)
    assert layer_noise.too_noisy(row(30.0, 30.0 + leeway + 0.1), floor)       # beyond its steps
    assert not layer_noise.too_noisy(row(30.0, 30.0 + leeway - 0.1), floor)
    assert layer_noise.rounding_limited(row(5.0, 8.0, 0.5))
    assert not layer_noise.too_noisy(row(5.0, 8.0, 0.5), floor)
    assert layer_noise.too_noisy(row(5.0, 8.0, 0.49), floor)                  # a range too wide
    assert layer_noise.too_noisy(row(5.0, 16.0, 0.9), floor)                  # beyond its steps
    assert layer_noise.why_noisy(row(5.0, 8.0, 0.9), floor) == (
        "conv, adds noise 5.0 dB below its values < export.min_layer_sqnr 20, within 10 dB of "
        "the 8.0 dB its own 8-bit steps allow; its values reach 90% of its 8-bit range's end "
        "(rounding-limited: the range is its values', the 8-bit file can do no better; "
        "calibrate on more examples or train with QAT)")
    # a gate nearly closed on every example: its values below one step, rounded to zero
    tiny = {**row(2.8, 3.1, 0.0), "signal_steps": 0.4}
    assert layer_noise.rounding_limited(tiny) and not layer_noise.too_noisy(tiny, floor)
    assert "0.40 of an 8-bit step (RMS): rounding-limited" in layer_noise.why_noisy(tiny, floor)
    assert layer_noise.too_noisy({**tiny, "signal_steps": 1.5}, floor)
    # ranges that clip 1% or more of a layer's values: never excused, even where its
    # inputs were already far from the model's (the exemption that was here let a range
    # 1/8 too narrow pass: `test_fidelity`'s narrowed range)
    clipped = {**row(11.2, 18.5, 0.56), "saturated": 0.05, "input_sqnr_db": -7.0}
    assert layer_noise.too_noisy(clipped, floor) and not layer_noise.rounding_limited(clipped)
    assert layer_noise.why_noisy(clipped, floor).endswith(
        "; its 8-bit ranges clip 5.0% of its values, fed inputs -7.0 dB from the model's "
        "(a range narrower than what the file computes there)")
    assert not layer_noise.too_noisy({**clipped, "saturated": 0.009}, floor)   # rounding-limited
    assert layer_noise.why_noisy(row(30.0), floor) == (
        "conv, adds noise 30.0 dB below its values >= export.min_layer_sqnr 20")
