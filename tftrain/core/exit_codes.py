"""The exit codes of tftrain's commands (run, launch, sweep, search) and the statuses a
run's summary.json ends with, in one place."""

OK = 0
RUNTIME = 1            # a runtime failure: a bug (with its traceback), a faulty artifact
CONFIG = 2             # bad config, arguments, data or files: one line each, nothing written
# a target or budget missed with something to ship: an artifact that works but loses more
# than export.max_accuracy_drop (every file kept, the best within budget named), a
# compression search that met no candidate (the front written, the closest exported)
TARGET_MISSED = 3
PREEMPTED = 42         # stopped at a safe point by SIGTERM/SIGINT: rerun to resume

# summary.json's `status`: every artifact verified; some only beyond their accuracy budget
# (exit 3); an artifact that computes something else (exit 1)
COMPLETED = "completed"
BUDGET_MISSED = "accuracy budget missed"
EXPORT_FAILED = "export verification failed"

# a compression search candidate's `status` in search.json: its run finished and was
# measured, was skipped (predicted beyond the target), refused by its config, failed, or
# has not run yet
DONE, SKIPPED, REFUSED, FAILED, NOT_RUN = "done", "skipped", "refused", "failed", "not run"
