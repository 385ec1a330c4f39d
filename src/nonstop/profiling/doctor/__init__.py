"""`nonstop doctor`: read a run directory, estimate the GPU-seconds each cause of idle time cost, rank them, and
name the configuration change for each."""

from nonstop.profiling.doctor.finding import Finding
from nonstop.profiling.doctor.report import Report, diagnose, format_report
from nonstop.profiling.doctor.run_data import RunData, RunDirError, load_run

__all__ = ["Finding", "Report", "RunData", "RunDirError", "diagnose", "format_report", "load_run"]
