"""`kvrelay bench routing` (command.py): the router's replica policies side by side on one prefix-heavy
multi-turn workload (workload.py), one `kvrelay up` stack per policy whose counters and routing log are
read by stack.py; the table is report.py's."""
