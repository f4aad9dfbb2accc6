"""``kiloserve doctor``: guided triage of a live gateway (issue 15, S5.4).

``probe.py`` reads the gateway and its engines (HTTP); ``diagnose.py`` holds the pure
rules that name the probable cause; ``cli.py`` prints the ranked findings.
"""
