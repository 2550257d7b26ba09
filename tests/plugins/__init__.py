"""Test-only parts that recipes load with job.plugins, to provoke faults in end-to-end runs."""
