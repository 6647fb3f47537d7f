"""Unmodified torchrun-style code under ``run()`` (spark_hvd.core.torchrun, spark_hvd.runner.script): a script's
sys.argv and torchrun's variables on both session kinds, env:// over the job's store beside the Horovod API in one
job, a function's return value, DDP and FSDP (``fully_shard``) at two ranks equal to one rank on the combined
batches, a failing script's traceback and exit status on the driver."""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import pytest

from spark_hvd.runner import RankFailedError, RunnerError, run

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


@pytest.mark.compat
def test_a_script_gets_its_argv_and_torchruns_environment(any_spark, tmp_path):
    results = run(os.path.join(SCRIPTS, "torchrun_report.py"), args=["--lr", "1e-3", "--dir", str(tmp_path)],
                  num_proc=2)
    assert results == [0, 0]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rep in enumerate(reports):
        assert rep["argv"] == ["--lr", "1e-3", "--dir", str(tmp_path)]
        assert rep["name"] == "__main__" and rep["file"] == "torchrun_report.py"
        assert rep["dist"] == [r, 2] and rep["hvd"][:2] == [r, 2]
        env = rep["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (str(r), "2", "2", "0")
        assert env["LOCAL_RANK"] == str(rep["hvd"][2])
        assert env["MASTER_ADDR"] == reports[0]["env"]["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
        assert rep["dist_sum"] == rep["hvd_sum"] == 3.0  # torch.distributed and the Horovod API in one job
        assert rep["store"] == "KVTorchStore"  # env:// met over the job's authenticated store, not a TCPStore


def _dist_fn(scale: float) -> tuple[str, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # left for the runner to destroy
    t = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    return os.environ["RANK"], t.item()


def test_a_function_returns_its_value_after_init_process_group(spark):
    assert run(_dist_fn, args=(2.0,), num_proc=2) == [("0", 6.0), ("1", 6.0)]
    assert run(_dist_fn, args=(1.0,), num_proc=2) == [("0", 3.0), ("1", 3.0)]  # the reused workers start clean


def test_ddp_and_fsdp_scripts_at_two_ranks_equal_one_rank_on_the_combined_batches(spark, tmp_path):
    import torch

    script = os.path.join(SCRIPTS, "ddp_train.py")
    for name, n, extra in (("one", 1, []), ("ddp", 2, []), ("fsdp", 2, ["--fsdp"])):
        run(script, args=["--out", str(tmp_path / f"{name}.pt"), *extra], num_proc=n)
    one, ddp, fsdp = (torch.load(tmp_path / f"{name}.pt") for name in ("one", "ddp", "fsdp"))
    assert set(one) == set(ddp) == set(fsdp) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for key in one:
        torch.testing.assert_close(ddp[key], one[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fsdp[key], one[key], rtol=1e-5, atol=1e-6)
    assert not torch.equal(one["0.weight"], torch.nn.Linear(8, 16).weight)  # it trained


def test_a_users_own_lightning_trainer_script(spark, tmp_path):
    pytest.importorskip("lightning")
    assert run(os.path.join(SCRIPTS, "lightning_trainer.py"), args=["--dir", str(tmp_path)], num_proc=2) == [0, 0]
    hooks = json.loads((tmp_path / "hooks.json").read_text())
    assert hooks == ["fit_start world=2 rank=0 env=TorchElasticEnvironment", "epoch_end 0", "epoch_end 1",
                     "fit_end"]
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    assert set(rows[0].split(",")) == {"epoch", "step", "train_loss"}
    assert len(rows) - 1 == 8  # 64 rows / 2 ranks / batch 8 = 4 steps an epoch, 2 epochs, logged every step


def test_a_failing_script_names_the_rank_with_its_traceback_and_exit_status(spark):
    script = os.path.join(SCRIPTS, "fails.py")
    with pytest.raises(RankFailedError) as raised:
        run(script, args=["--raise-on", "1"], num_proc=2)
    err = raised.value
    assert err.rank == 1 and err.remote_type == "ValueError" and "nan on rank 1" in err.remote_message
    assert "fails.py" in err.remote_traceback and "train_step" in err.remote_traceback
    assert "raise ValueError" in err.remote_traceback  # the script's source line, shipped from the driver
    assert err.exit_code is None
    with pytest.raises(RankFailedError) as raised:
        run(script, args=["--exit-on", "0", "--code", "3"], num_proc=2)
    assert raised.value.rank == 0 and raised.value.exit_code == 3
    assert run(script, args=["--exit-on", "0", "--code", "0"], num_proc=2) == [0, 0]  # sys.exit(0) is success


def test_a_bad_script_is_refused_on_the_driver(tmp_path):
    with pytest.raises(RunnerError, match="cannot read the script"):
        run(str(tmp_path / "missing.py"), num_proc=2)
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(:\n")
    with pytest.raises(RunnerError, match="does not compile"):
        run(str(bad), num_proc=2)
    with pytest.raises(RunnerError, match="must be strings"):
        run(os.path.join(SCRIPTS, "fails.py"), args=["--code", 3], num_proc=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_elastic_runs_a_script_again_after_a_lost_rank(spark, tmp_path):
    from spark_hvd.runner import run_elastic

    results = run_elastic(os.path.join(SCRIPTS, "elastic_train.py"), args=["--dir", str(tmp_path)], num_proc=2,
                          min_num_proc=1, max_num_proc=2, reset_limit=1, verbose=0)
    assert results == [0, 0] and (tmp_path / "killed").exists()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:
        # the relaunch ran the script from the top; hvd.elastic.run restored epoch 1 after its 3 committed batches
        assert rep["starts"] == [[1, 3 * 2 * 2]], rep
        assert rep["world"] == "2" and rep["restart_count"] == "1", rep
    assert reports[0]["weights"] == reports[1]["weights"]
