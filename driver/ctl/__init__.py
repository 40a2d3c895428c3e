"""`tandemctl`: the SRE's command line, a client of the status socket."""
