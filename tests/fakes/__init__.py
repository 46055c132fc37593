"""Fakes of vendor libraries and peers, used by the tests through the real client code."""
