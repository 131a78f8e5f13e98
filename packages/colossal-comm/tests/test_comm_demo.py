"""The bandwidth demo runs end to end and prints one row per op and size."""

from colossal.comm import demo


def test_demo_prints_nccl_tests_table(capsys):
    demo.main(["--nproc", "2", "--sizes", "4K,64K", "--ops", "all_reduce,all_gather", "--iters", "2", "--warmup", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# colossal.comm bus bandwidth: 2 ranks")
    rows = [line.split() for line in out[2:]]
    assert [(r[0], int(r[1])) for r in rows] == [
        ("all_reduce", 4096),
        ("all_reduce", 65536),
        ("all_gather", 4096),
        ("all_gather", 65536),
    ]
    for r in rows:  # busbw = algbw * bus factor (1 for all_reduce at n=2, 1/2 for all_gather)
        factor = 1.0 if r[0] == "all_reduce" else 0.5
        assert abs(float(r[4]) - float(r[3]) * factor) <= 0.002
