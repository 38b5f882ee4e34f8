from swa_bench.cli import app

app(prog_name="swa-bench")
