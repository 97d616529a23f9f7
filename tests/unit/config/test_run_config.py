"""YAML configs validate into typed sections; bad keys and values are named by dotted path."""

import subprocess
import sys
from pathlib import Path

import pytest

from mt_ray.config.run import apply_override, describe_config, load_run_config
from mt_ray.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "jobs" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_validate(path):
    cfg = load_run_config(path)
    assert cfg.training.steps > 0


DEMOS = ("demo", "dpo_demo", "grpo_demo", "kto_demo")


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem not in DEMOS], ids=lambda p: p.stem)
def test_model_configs_carry_the_calculators_batch_for_an_80gb_gpu(path):
    from mt_ray.engine.calculator import recommend
    from mt_ray.models.discovery import discover
    from mt_ray.models.presets import preset_config

    cfg = load_run_config(path)
    global_batch = cfg.training.micro_batch_size * cfg.training.grad_accum_steps
    rec = recommend(discover(preset_config(cfg.model.preset)), cfg.data.max_seq_len, global_batch,
                    gpu_mem_gb=80, host_mem_gb=1024, cfg=cfg.engine, opt=cfg.optimizer)
    ours = (cfg.engine.schedule, cfg.training.micro_batch_size, cfg.engine.checkpoint_every)
    assert ours == (rec["schedule"], rec["micro_batch_size"], rec["checkpoint_every"])


def test_defaults_are_the_embedded_demo():
    cfg = load_run_config()
    assert cfg.model.preset == "tiny" and cfg.model.path is None
    assert cfg.data.datasets == ["demo_alpaca", "demo_sharegpt"]


def test_overrides_parse_yaml_values():
    cfg = load_run_config(None, ["training.steps=7", "optimizer.betas=[0.9, 0.95]", "engine.host_memory_limit_gb=null"])
    assert cfg.training.steps == 7 and cfg.optimizer.betas == (0.9, 0.95)


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("training:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"training\.stepz: unknown key; did you mean 'steps'\?"):
        load_run_config(p)
    with pytest.raises(ConfigError, match=r"optimizer\.lrr: unknown key; did you mean 'lr'\?"):
        load_run_config(None, ["optimizer.lrr=1e-4"])
    with pytest.raises(ConfigError, match=r"trainng: unknown key; did you mean 'training'\?"):
        load_run_config(None, ["trainng.steps=3"])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"engine\.checkpoint_every: "):
        load_run_config(None, ["engine.checkpoint_every=0"])
    with pytest.raises(ConfigError, match=r"optimizer\.schedule: "):
        load_run_config(None, ["optimizer.schedule=exponential"])
    with pytest.raises(ConfigError, match=r"engine\.device: .*pattern"):
        load_run_config(None, ["engine.device=tpu"])


def test_malformed_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_override({}, "training.steps")
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_run_config(p)


def test_every_key_is_documented():
    text = describe_config()
    for line in text.splitlines():
        if line.startswith("  "):
            assert "# " in line and not line.rstrip().endswith("#"), line


def test_cluster_section_defaults_to_one_in_process_engine():
    cfg = load_run_config()
    assert cfg.cluster.num_workers == 1 and cfg.cluster.snapshot_every == 0
    cfg = load_run_config(None, ["cluster.num_workers=2", "cluster.cpus_per_worker=0.5"])
    assert cfg.cluster.num_workers == 2 and cfg.cluster.cpus_per_worker == 0.5
    assert "\n  num_workers: 1  # " in describe_config()


def test_cluster_workers_must_be_able_to_share_the_batch():
    # 2 micro-batches of 4 rows: 2 workers take whole micro-batches, 4 take a row each of both.
    load_run_config(None, ["cluster.num_workers=4", "training.micro_batch_size=4", "training.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match=r"cluster\.num_workers: 8 workers cannot share .* at most 4 workers"):
        load_run_config(None, ["cluster.num_workers=8", "training.micro_batch_size=4", "training.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match=r"cluster\.num_workers: "):
        load_run_config(None, ["cluster.num_workers=0"])
    with pytest.raises(ConfigError, match=r"cluster: num_workers \(3\) must be a multiple of num_nodes \(2\)"):
        load_run_config(None, ["cluster.num_workers=3", "cluster.num_nodes=2"])


def test_the_cluster_config_does_not_import_ray():
    code = "import sys; from mt_ray.cluster import ClusterConfig; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_optimizer_threads_default_to_the_cores_this_process_may_use(monkeypatch):
    # Not OMP_NUM_THREADS or torch's own count: Ray sets those to 1 in actors that reserve no CPU.
    from mt_ray.engine import EngineConfig

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineConfig().optimizer_thread_count == 15
    assert EngineConfig(optimizer_threads=3).optimizer_thread_count == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert EngineConfig().optimizer_thread_count == 1


def test_a_length_on_the_command_line_replaces_the_files_in_one_line(tmp_path, capsys):
    """LLaMA-Factory's YAML without num_train_epochs still runs its default 3 epochs; `training.steps=3` replaces
    them, as it replaces a native file's `training.epochs`; both on the command line stay refused."""
    lf = tmp_path / "lf.yaml"
    lf.write_text("model_name_or_path: model\nstage: sft\ndataset: identity\ntemplate: qwen\n")
    assert load_run_config(lf).training.epochs == 3.0
    capsys.readouterr()
    cfg = load_run_config(lf, ["training.steps=3"])
    assert (cfg.training.steps, cfg.training.epochs) == (3, None)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"training.steps=3 from the command line replaces training.epochs 3.0 of {lf}")
    native = tmp_path / "native.yaml"
    native.write_text("training:\n  steps: 40\n")
    cfg = load_run_config(native, ["training.epochs=0.5"])
    assert (cfg.training.steps, cfg.training.epochs) == (60, 0.5)  # the default steps: counted from the epochs
    assert capsys.readouterr().out.strip() == (
        f"training.epochs=0.5 from the command line replaces training.steps 40 of {native}")
    with pytest.raises(ConfigError, match="give training.steps or training.epochs, not both"):
        load_run_config(None, ["training.steps=3", "training.epochs=1"])
