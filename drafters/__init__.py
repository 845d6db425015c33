"""Drafters: propose token trees for the target to verify (protocol in ``drafters.base``)."""

from drafters.base import BaseDrafter, DraftContext, Drafter

__all__ = ["BaseDrafter", "DraftContext", "Drafter"]
