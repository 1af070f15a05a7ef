"""`kvrelay bench admission` (command.py): one tenant flooding at ten times its quota while another is
measured, against a real stack; the requests and the end-state readings are flood.py's."""
