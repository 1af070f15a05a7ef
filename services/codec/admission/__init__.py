"""Admission: who the caller is (auth, tenancy), whether the request fits (context rules), quotas (memory
and Redis stores), the fair queue, and the one gate that holds a quota reservation and a slot.
"""
