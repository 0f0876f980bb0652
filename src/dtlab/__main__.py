import sys

from dtlab.runtime.lifeline import die_with_parent

die_with_parent()  # a rank dies with the agent that started it (dtlab.runtime.lifeline)

from dtlab.cli import main  # noqa: E402
from dtlab.runtime import status  # noqa: E402

status.ENDS_WITHOUT_TEARDOWN = True
code = main()
# A process that ran a process group ends without the interpreter's teardown: destroying torch's C++
# objects there (gloo's threads, pending pipeline receives) can abort or hang a run that succeeded.
dist_module = sys.modules.get("dtlab.parallel.dist")
if status.is_worker_env() or (dist_module is not None and dist_module._RETIRED_GROUPS):
    status.leave_worker(code)  # see there
sys.exit(code)
