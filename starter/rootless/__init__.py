"""A starter with no root anywhere: a pilot's (a glidein's) own jobs.

userns.py enters the starter's own user namespace, where it is root over
what it then makes (the job's namespaces, its network namespace's rules, the
cgroups delegated to the pilot); pilot.py holds what such a starter does
differently (its state, its cgroup, its job's ids, what it cannot enforce).
"""
