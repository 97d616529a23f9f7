"""The consumer-card benchmark plans each cap with the calculator: its dry run is that plan, no GPU needed."""

from bench.consumer_caps import main


def test_every_cap_gets_a_configuration_that_fits_it(capsys):
    rows = main(["--dry-run", "--host-mem-gb", "128"])
    assert [r["cap_gib"] for r in rows] == [24.0, 16.0, 10.0]
    for r in rows:
        assert r["fits"] and r["calc_gpu_gib"] <= 0.9 * r["cap_gib"] and r["calc_host_gib"] <= 125
        assert r["micro_batch_size"] and 64 % r["micro_batch_size"] == 0
    # The smallest card parks its checkpoints in host memory, one layer a block.
    assert rows[-1]["config"]["checkpoint_placement"] == "host" and rows[-1]["config"]["checkpoint_every"] == 1
    assert "checkpoint_placement" in capsys.readouterr().out


def test_a_host_too_small_is_the_calculators_reason_not_a_run():
    rows = main(["--dry-run", "--host-mem-gb", "64", "--caps", "24"])
    assert not rows[0]["fits"] and rows[0]["error"].startswith("calculator: host:")
