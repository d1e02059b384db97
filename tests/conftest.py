"""Shared pytest settings for the Python suites (tests/sdk, tests/llamacpp, tests/tokens, ...).

A skipped test is a failure: a green run must mean every test it ran was run. To leave a suite
out, name it (`bash tests/run-all.sh --without vllm`): it is then not run at all, rather than
run and skipped. (`AUTOHEDGE_ALLOW_SKIPS=1` turns this off for a run by hand.)
"""
import os


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("AUTOHEDGE_ALLOW_SKIPS") == "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"{len(skipped)} skipped test(s) count as failures (leave a suite out by name: run-all.sh --without NAME)", red=True)
        session.exitstatus = 1
