"""Multi-worker training with real localhost worker processes, and fault tolerance."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import (ROOT, digit_tfrecords, model_weights, quick_config, resumed_at,
                     start_run, wait_for_checkpoint)
from tftrain.launch import _wait, cpu_sets, free_ports, gpu_sets, local_gpus, worker_env
from tftrain.run import run

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
EPOCHS = 4
SETS = ["distribute.strategy=auto", "distribute.virtual_cpus=1",     # 1 replica per worker
        f"train.epochs={EPOCHS}", "export.tflite=none",
        "train.checkpoint.every=10", "run.deterministic=true", "train.verbose=0",
        "export.preflight=false"]       # (test_preflight.py's)
PLANNED = EPOCHS * (1527 // 64)


def launch(run_dir, *sets, workers=2, data_workers=0, start="auto"):
    """`python -m tftrain.launch` in a session of its own, forked from the fork server
    (TensorFlow imported, no op run), so it forks its workers (`--start auto` without
    GPUs) as a launcher started fresh would after its import."""
    args = ["--workers", str(workers), "--data-workers", str(data_workers), "--start", start,
            str(QUICKSTART), "--run-dir", str(run_dir),
            *[a for s in (*SETS, *sets) for a in ("--set", s)]]
    return start_run(*args, module="tftrain.launch", session=True, stderr=subprocess.STDOUT)


def sigkill(proc):
    """SIGKILL a launch: its workers (each in a session of its own), then the launcher.
    Killing the launcher alone would have each worker sent SIGTERM (PR_SET_PDEATHSIG),
    which it answers by saving a checkpoint and stopping: a clean stop, not a kill."""
    def children(pid):
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and \
                        int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
        return found
    for pid in children(proc.pid):
        for victim in (*children(pid), pid):
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.killpg(proc.pid, signal.SIGKILL)


def finish(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        sigkill(proc)
        raise AssertionError("workers did not finish in time (hang)")
    return proc.returncode, out


def digests(out):
    return {line.split("]")[0] + "]": line.split("sha256: ")[1].strip()
            for line in out.splitlines() if "final weights sha256" in line}


def test_helpers():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    env = json.loads(worker_env(1, ports)["TF_CONFIG"])
    assert env["task"] == {"type": "worker", "index": 1} and len(env["cluster"]["worker"]) == 3
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_sets(2, 1) == [{cpus[0]}, {cpus[1 % len(cpus)]}]
    assert cpu_sets(2, None) == [None, None]


def test_each_worker_gets_its_own_gpus(monkeypatch):
    assert gpu_sets(2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert gpu_sets(2, ["4", "6"]) == ["4", "6"]
    assert gpu_sets(3, []) == [None, None, None]
    with pytest.raises(ValueError, match="3 workers for 2 GPUs"):
        gpu_sets(3, ["0", "1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert local_gpus() == ["2", "3"]
    assert worker_env(1, [1, 2], "3")["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == []


def _worker(code, after=0.0):
    """A stand-in worker; returned once its SIGTERM handler is installed (a signal that
    came before would end it with -15 instead of its own 7, as a slow start on a loaded
    machine showed)."""
    source = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
              f"print('ready', flush=True); time.sleep({after}); sys.exit({code})")
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_wait_lets_preempted_workers_finish_and_stops_failed_ones():
    procs = [_worker(42), _worker(42, after=1.5)]      # both preempted, one slower to save
    assert _wait(procs) == 42 and [p.returncode for p in procs] == [42, 42]
    procs = [_worker(1), _worker(0, after=30)]         # a crash stops the others at once
    assert _wait(procs) == 1 and procs[1].returncode == 7


def scratch_dirs(run_path):
    """The non-chief workers' scratch checkpoint directories of a run that still exist."""
    import hashlib
    import tempfile
    key = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:12]   # as scratch_dir names it
    return [p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"tftrain-worker-{key}-")]


@pytest.mark.slow
def test_two_workers_agree_and_equal_one_worker_with_two_replicas(two_workers, tmp_path):
    path, out = two_workers
    summary = json.loads((path / "summary.json").read_text())
    assert summary["strategy"] == "multi_worker" and summary["workers"] == 2
    assert summary["replicas"] == 2 and summary["steps"] == PLANNED
    found = digests(out)
    assert len(found) == 2 and len(set(found.values())) == 1      # identical final weights
    mirrored = run(quick_config(tmp_path, *[s for s in SETS if not s.startswith("distribute.")],
                                "distribute.strategy=mirrored"))
    assert abs(mirrored["metrics"]["val_accuracy"] - summary["metrics"]["val_accuracy"]) <= 0.01
    ours, reference = model_weights(path), model_weights(tmp_path / "quickstart")
    assert ours.keys() == reference.keys() and ours
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_data_workers_feed_the_same_batches(two_workers, tmp_path):
    code, out = finish(launch(tmp_path, data_workers=2))
    assert code == 0, out[-3000:]
    assert out.count("[data ") >= 2 and "tf.data service: dispatcher grpc://localhost:" in out
    assert digests(out) == digests(two_workers[1])        # bit-identical training


@pytest.mark.slow
def test_a_cluster_step_runs_only_the_gradient_all_reduce_and_checks_are_batched(two_workers):
    path, _ = two_workers
    summary = json.loads((path / "summary.json").read_text())
    host = summary["throughput"]["host"]
    parameters = sum(w.size for w in model_weights(path).values())
    # the compiled step holds only the gradients' all-reduce (every parameter once, in
    # float32): no flag exchange, no metric reduction, no step-counter broadcast
    found = {tuple(sorted(c.items())) for c in host["step_collectives"]}
    assert found == {
        (("dtype", "float32"), ("elements", parameters), ("op", "CollectiveReduceV2"))}
    # flags are exchanged between calls, at most once per call and once per epoch end
    assert host["steps_per_execution"] > 1 and host["calls"] < summary["steps"]
    assert host["checks"] <= host["calls"] + EPOCHS < summary["steps"]


@pytest.mark.slow
def test_only_the_chief_writes(two_workers):
    path, out = two_workers
    assert "export saved_model" in out and out.count("export saved_model") == 1
    # beside the run: the MLflow store the fixture tracks to, and its artifacts
    assert sorted(p.name for p in path.parent.iterdir()) == ["mlartifacts", "mlflow.db", "quickstart"]


@pytest.mark.slow
def test_a_two_worker_launch_logs_one_mlflow_run(two_workers):
    from mlflow.tracking import MlflowClient
    path, _ = two_workers
    client = MlflowClient(f"sqlite:///{path.parent}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("launch").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(EPOCHS))
    assert runs[0].data.params["distribute.strategy"] == "auto"


def _children(pid):
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


@pytest.mark.slow
def test_interrupted_run_relaunches_to_the_same_weights(two_workers, tmp_path):
    """One 2-worker run interrupted four ways in turn, relaunched after each: worker 1
    SIGKILLed mid-epoch; worker 1 alone sent SIGTERM (a scheduler evicting one task: both
    stop with exit 42); the launcher sent SIGTERM (forwarded to both); one Ctrl-C at the
    terminal (SIGINT to the launcher's process group: exit 42, not the second-Ctrl-C
    abort). The last relaunch ends with the weights of the run never interrupted."""
    checkpoints = tmp_path / "quickstart" / "checkpoints"
    last = 0
    for how, at_least in (("sigkill-worker", 20), ("sigterm-one-worker", 40),
                          ("sigterm-launcher", 60), ("ctrl-c", 80)):
        proc = launch(tmp_path)
        saved = wait_for_checkpoint(checkpoints, proc, at_least=at_least)
        if how == "sigkill-worker":
            os.kill(_children(proc.pid)[1], signal.SIGKILL)          # worker 1, mid-epoch
            code, out = finish(proc)
            assert code != 0
        elif how == "sigterm-one-worker":
            os.kill(_children(proc.pid)[1], signal.SIGTERM)
            code, out = finish(proc)
            assert code == 42, out[-3000:]
            assert "[worker 1] tftrain: stopped by SIGTERM" in out
            assert "[worker 0] tftrain: stopped by a signal to another worker" in out
        elif how == "sigterm-launcher":
            proc.send_signal(signal.SIGTERM)                          # forwarded to both workers
            code, out = finish(proc)
            assert code == 42, out[-3000:]
            assert out.count("stopped by SIGTERM") == 2
        else:           # a terminal's Ctrl-C: SIGINT to the launcher's whole process group
            os.killpg(proc.pid, signal.SIGINT)
            code, out = finish(proc)
            assert code == 42, out[-3000:]                            # a clean stop, saved
            assert out.count("stopped by SIGINT") == 2 and "tftrain: interrupted" not in out
        if last:
            assert "resuming from" in out
        assert last < saved < PLANNED and not (tmp_path / "quickstart" / "summary.json").exists()
        last = saved
    code, out = finish(launch(tmp_path))
    assert code == 0, out[-3000:]
    assert "resuming from" in out
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == PLANNED
    ours, reference = model_weights(tmp_path / "quickstart"), model_weights(two_workers[0])
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-6)


# (workers, settings): 2 workers of 1 replica x 32 (the `two_workers` run); 1 worker of 2
# replicas on 2 virtual CPUs x 16 x 2 accumulation steps; 2 workers of 2 replicas each
# x 16, accumulation halved: 64 examples per update on each
TOPOLOGIES = {"2x1": (2, []),
              "1x2": (1, ["distribute.virtual_cpus=2", "data.per_replica_batch_size=16",
                          "train.accumulation_steps=2"]),
              "2x2": (2, ["distribute.virtual_cpus=2", "data.per_replica_batch_size=16"])}


def kill_and_resume(run_dir, plan, *sets):
    """Launch on each (topology, kill point) of `plan` (`tests/killpoints.py`: every worker
    SIGKILLs itself there), the last left to finish. Each resume starts from the chief's
    newest checkpoint and says which topology it leaves; the last launch's output."""
    last = 0
    for i, (name, kill) in enumerate(plan):
        workers, topology = TOPOLOGIES[name]
        args = ["--workers", str(workers), str(QUICKSTART), "--run-dir", str(run_dir),
                *[a for s in (*SETS, *topology, *sets) for a in ("--set", s)]]
        proc = start_run("tftrain.launch", *args, module="tests.killpoints", session=True,
                         stderr=subprocess.STDOUT,
                         env={**os.environ, "TFTRAIN_KILL": kill or "", "PYTHONPATH": str(ROOT)})
        code, out = finish(proc)
        if kill is None:
            assert code == 0, out[-3000:]
        else:
            assert code != 0 and "killpoint: " in out, out[-3000:]
        if i:
            before = TOPOLOGIES[plan[i - 1][0]][0]
            assert f"resuming on a different topology: {before} worker(s)" in out, out[-3000:]
            assert last <= resumed_at(out)                       # from the chief's newest
            last = resumed_at(out)
    return out


@pytest.mark.slow
def test_a_killed_launch_on_uneven_file_shards_with_padding_and_augmentation_resumes_exactly(
        tmp_path):
    """Digits in 5 uneven TFRecord training files, FILE sharding (2 file streams),
    data.remainder: pad and random crops: killed as 2 workers, as 1 worker of 2 replicas,
    finished as 2 workers of 2: the weights equal the uninterrupted 2-worker run's (each
    update read the same examples from the reassigned files, cropped alike)."""
    sizes = [300, 330, 290, 310, 270, 297]                # part-0: validation; 5 for training
    (tmp_path / "files").mkdir()
    digit_tfrecords(tmp_path / "files", sizes)
    sets = ["data.name=tfrecord", "data.validation_fraction=0.17", "data.shard_policy=file",
            f"data.params={{files: '{tmp_path}/files/part-*.tfrecord', shape: [8, 8, 1], "
            "num_classes: 10}", "data.cache=none", "data.remainder=pad",
            "data.augment=[{random_crop: {padding: 1}}]", "train.epochs=3",
            # no ties to break differently on another topology (test_elastic.py's docstring)
            "model.params={filters: [32, 64], dense: [128], pool: avg}"]
    code, out = finish(launch(tmp_path / "reference", *sets))
    assert code == 0, out[-3000:]
    # 2 streams: files 1, 3, 5 (937 examples) and 2, 4 (560); 32 of each per update
    assert "sharding: FILE: each worker reads its own files (2 workers, 2 file streams)" in out
    assert "remainder: pad (423 padding slots per epoch, weighted 0)" in out
    out = kill_and_resume(tmp_path, [("2x1", "update:25"), ("1x2", "step:55"), ("2x2", None)],
                          *sets)
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == 3 * 30 and summary["replicas"] == 4
    ours = model_weights(tmp_path / "quickstart")
    reference = model_weights(tmp_path / "reference" / "quickstart")
    assert ours.keys() == reference.keys() and ours
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-5)


def task(run_dir, env, *sets):
    """One `tftrain.run` process of a cluster, started as a scheduler would with `env` (in
    a session of its own; forked from the fork server: TF_CONFIG and SLURM's variables are
    read when the run starts, not when TensorFlow is imported)."""
    args = [str(QUICKSTART), "--run-dir", str(run_dir),
            *[a for s in (*SETS, *sets) for a in ("--set", s)]]
    return start_run(*args, env={**env, "PYTHONPATH": str(ROOT)}, session=True,
                     stderr=subprocess.STDOUT)


def srun(run_dir, tasks, rank, port_base, *sets):
    """Task `rank` of a SLURM job step of `tasks` tasks on this node, as srun starts it."""
    return task(run_dir, {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TF_CONFIG"))},
        "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_PROCID": str(rank),
        "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "TFTRAIN_PORT_BASE": str(port_base)}, *sets)


@pytest.mark.slow
def test_a_slurm_job_requeued_on_fewer_tasks_continues_with_no_config_change(two_workers,
                                                                           tmp_path):
    """A 2-task SLURM step SIGKILLed mid-epoch, requeued as 1 task with the same command:
    train.global_batch_size keeps 64 examples per update (1 replica x 64), and the weights
    equal the uninterrupted 2-worker run's."""
    sets = ["train.global_batch_size=64"]
    base = free_ports(1)[0]
    tasks = [srun(tmp_path, 2, rank, base, *sets) for rank in range(2)]
    wait_for_checkpoint(tmp_path / "quickstart" / "checkpoints", tasks[0], at_least=30)
    for task in tasks:
        os.killpg(task.pid, signal.SIGKILL)
        task.communicate(timeout=60)
    code, out = finish(srun(tmp_path, 1, 0, base, *sets))
    assert code == 0, out[-3000:]
    assert ("resuming on a different topology: 2 worker(s), 2 replica(s) x 32 x 1 accumulation "
            "= global batch 64, float32 with a float32 all-reduce -> 1 worker(s), 1 replica(s) "
            "x 64 x 1 accumulation") in out, out[-3000:]
    assert resumed_at(out) >= 30
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == PLANNED and summary["workers"] == 1
    ours, reference = model_weights(tmp_path / "quickstart"), model_weights(two_workers[0])
    assert ours.keys() == reference.keys() and ours
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-5)


def worker(run_dir, index, ports, *sets):
    """Worker `index` of a localhost cluster, started by hand with a run directory of its
    own (as on machines that do not share one)."""
    return task(run_dir, worker_env(index, ports), *sets)


@pytest.mark.slow
def test_workers_whose_checkpoints_differ_restore_the_chiefs_choice_or_stop(tmp_path):
    """A 2-worker run SIGKILLed, resumed by workers that each see their own copy of the
    run directory. Worker 1's copy does not list the newest checkpoint: it loads the one
    the chief chose, and both end on the same weights. Worker 1's copy lacks it: worker 1
    stops with exit 1 naming the path, before any update."""
    import shutil
    sets = ["train.epochs=2"]
    proc = launch(tmp_path / "a", *sets)
    import re
    wait_for_checkpoint(tmp_path / "a" / "quickstart" / "checkpoints", proc, at_least=20)
    sigkill(proc)
    proc.communicate(timeout=60)
    state = (tmp_path / "a" / "quickstart" / "checkpoints" / "checkpoint").read_text()
    newest = max(int(n) for n in re.findall(r'all_model_checkpoint_paths: "ckpt-(\d+)"', state))
    for copy in "bcd":
        shutil.copytree(tmp_path / "a", tmp_path / copy)
    lagging = tmp_path / "b" / "quickstart" / "checkpoints" / "checkpoint"      # the state file
    kept = [n for n in re.findall(r'all_model_checkpoint_paths: "ckpt-(\d+)"', lagging.read_text())
            if int(n) != newest]
    lagging.write_text(f'model_checkpoint_path: "ckpt-{kept[-1]}"\n' + "".join(
        f'all_model_checkpoint_paths: "ckpt-{n}"\n' for n in kept))
    for f in (tmp_path / "d" / "quickstart" / "checkpoints").glob(f"ckpt-{newest}.*"):
        f.unlink()

    ports = free_ports(2)
    procs = [worker(tmp_path / "a", 0, ports, *sets), worker(tmp_path / "b", 1, ports, *sets)]
    runs = [finish(p) for p in procs]
    assert [code for code, _ in runs] == [0, 0], runs[1][1][-3000:]
    assert [resumed_at(out) for _, out in runs] == [newest, newest]
    finals = [line for _, out in runs for line in out.splitlines() if "final weights sha256" in line]
    assert len(finals) == 2 and finals[0] == finals[1]

    ports = free_ports(2)
    procs = [worker(tmp_path / "c", 0, ports, *sets), worker(tmp_path / "d", 1, ports, *sets)]
    code, out = finish(procs[1])
    os.killpg(procs[0].pid, signal.SIGKILL)          # (the chief waits for its peer)
    procs[0].communicate(timeout=60)
    assert code == 1, out[-3000:]
    assert (f"worker 1 cannot read {tmp_path / 'd' / 'quickstart' / 'checkpoints'}/ckpt-{newest}, "
            "the checkpoint the chief restored") in out


@pytest.mark.slow
def test_uneven_shards_finish(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(1001, 6)).astype(np.float32), rng.integers(0, 3, 1001)
    np.savez(tmp_path / "odd.npz", x=x, y=y)
    proc = launch(tmp_path, "data.name=npz", f"data.params={{path: {tmp_path / 'odd.npz'}}}",
                  "model={name: mlp, params: {hidden: [16]}}", "data.validation_fraction=0.101",
                  "data.per_replica_batch_size=50", "train.epochs=2")
    code, out = finish(proc, timeout=240)
    assert code == 0, out[-3000:]
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == 2 * (900 // 100)


PROBE = """
import json, sys
import tftrain
import tensorflow as tf
from tftrain.config import load_config
from tftrain.data import BatchPlan, distribute, epoch_layout, load_source
strategy = tf.distribute.MultiWorkerMirroredStrategy()
cfg = load_config(None, sys.argv[1:-1])
source = load_source(cfg.data, 0)
plan = BatchPlan(cfg.data.per_replica_batch_size, strategy.num_replicas_in_sync, 1)
steps = epoch_layout(source, plan, cfg.data, 2).steps()
seen = []
for i, batch in enumerate(distribute(strategy, source, plan, cfg.data, 0)):
    if i == 2 * steps:
        break
    for part in strategy.experimental_local_results(batch[0]):
        seen += [[int(v) for v in row] for row in part.numpy()]
json.dump({"seen": seen, "steps": steps}, open(sys.argv[-1], "w"))
"""


def write_shards(directory, examples):
    """4 TFRecord shards of `examples` (x, y) in turn; returns the glob."""
    import tensorflow as tf
    directory.mkdir()
    writers = [tf.io.TFRecordWriter(str(directory / f"part-{s}.tfrecord")) for s in range(4)]
    for i, (x, y) in enumerate(examples):
        writers[i % 4].write(tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=list(np.ravel(x)))),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y)]))})).SerializeToString())
    for w in writers:
        w.close()
    return f"{directory}/part-*.tfrecord"


@pytest.mark.slow
def test_two_workers_read_disjoint_tfrecord_files_each_example_once_per_epoch(tmp_path):
    from tftrain.launch import free_ports
    pattern = write_shards(tmp_path / "ids", [((k + 1, k % 4), k % 3) for k in range(103)])
    sets = ["data.name=tfrecord", "data.validation_fraction=0", "data.remainder=pad",
            f"data.params={{files: '{pattern}', shape: [2], num_classes: 3}}",
            "data.per_replica_batch_size=4", "data.shuffle_buffer=8"]
    ports = free_ports(2)
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, *sets, str(tmp_path / f"w{w}.json")],
                              env={**worker_env(w, ports), "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    results = [json.loads((tmp_path / f"w{w}.json").read_text()) for w in range(2)]
    steps = results[0]["steps"]
    # worker 0 reads files 0 and 2 (26 + 26 examples), worker 1 files 1 and 3 (26 + 25),
    # 4 per worker and update: 13 updates, one padding slot (0, 0) on worker 1
    assert steps == results[1]["steps"] == 13
    for epoch in range(2):
        parts = [[tuple(r) for r in res["seen"][epoch * 52:(epoch + 1) * 52]] for res in results]
        files = [{s for i, s in part if i} for part in parts]
        assert files == [{0, 2}, {1, 3}]
        assert sorted(i for part in parts for i, _ in part if i) == list(range(1, 104))
        assert [part.count((0, 0)) for part in parts] == [0, 1]
    assert results[0]["seen"][:52] != results[0]["seen"][52:]          # reshuffled per epoch


@pytest.mark.slow
def test_two_workers_train_on_tfrecord_shards(tmp_path):
    from sklearn.datasets import load_digits
    digits = load_digits()
    pattern = write_shards(tmp_path / "digits", zip(digits.images / 16.0, digits.target))
    proc = launch(tmp_path, "data.name=tfrecord",
                  f"data.params={{files: '{pattern}', shape: [8, 8, 1], num_classes: 10}}",
                  "data.validation_fraction=0.25", "train.epochs=3", "data.cache=none")
    code, out = finish(proc, timeout=300)
    assert code == 0, out[-3000:]
    assert "sharding: FILE: each worker reads its own files (2 workers, 2 file streams)" in out
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["metrics"]["val_accuracy"] > 0.8
