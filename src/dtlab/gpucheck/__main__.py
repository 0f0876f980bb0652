from dtlab.cliargs import run_command
from dtlab.gpucheck import main

raise SystemExit(run_command(main))
