"""What of TensorFlow's own logging reaches a command's console."""
import logging

from tftrain.core import native_log


def test_tensorflow_python_warnings_are_held_errors_kept():
    """After `python_warnings_held()` (the CLI without --verbose), the warning Keras
    prints for a slow callback reaches no handler of TensorFlow's logger; an error still
    does; holding twice adds one filter."""
    import tensorflow as tf
    logger = tf.get_logger()
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    handler, before = Seen(), list(logger.filters)
    logger.addHandler(handler)
    logger.filters[:] = [f for f in before if f is not native_log._errors_only]  # (a CLI run
    try:                                                        # in this process held them)
        logger.warning("shown before")
        assert seen == ["shown before"]
        seen.clear()
        before_hold = list(logger.filters)
        native_log.python_warnings_held()
        native_log.python_warnings_held()
        assert len(logger.filters) == len(before_hold) + 1
        logger.warning("Callback method `on_train_batch_end` is slow compared to the batch time")
        logger.error("a real error")
        assert seen == ["a real error"]
        logger.filters[:] = before_hold
        logger.warning("shown again")
        assert seen == ["a real error", "shown again"]
    finally:
        logger.filters[:] = before
        logger.removeHandler(handler)
