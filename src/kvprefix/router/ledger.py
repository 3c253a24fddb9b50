"""Route and account: the one place a routing decision becomes load on a replica.

The planner's replay, `kvprefix route` and the Ray Serve router each hold one ``Ledger``: it asks the policy for a
``Decision`` over a ``FleetView`` and records the request in the chosen replica's ``Outstanding`` (the blocks the
decision did not credit as its queued prefill; its blocks as pending, for the policies that read the view's
cache), returning the ``Routed`` share that the caller settles when the first token is out and when the request
ends. Choosing and recording are separate steps where the caller needs them apart: the planner rejects a request
that can never fit between the two, and Ray records only when a replica has accepted the request.
"""

from __future__ import annotations

from dataclasses import replace

from kvprefix.router.fleet import FleetView
from kvprefix.router.pending import Outstanding, Routed
from kvprefix.router.policies import Decision, Routable, RoutingPolicy


class Ledger:
    def __init__(self, policy: RoutingPolicy):
        self.policy = policy
        # Only a policy that asks the view what replicas cache needs the blocks of requests in flight counted;
        # ``prefix`` remembers where it sent blocks on its own.
        self._pending_blocks = policy.reads_cache

    def choose(self, request: Routable, view: FleetView, refused: tuple[str, ...] = ()) -> Decision:
        """The policy's decision; a retry (``refused``: the replicas that failed or refused the request first)."""
        decision = self.policy.choose(request, view)
        return replace(decision, reason="retry", refused=refused) if refused else decision

    def record(self, request: Routable, decision: Decision, outstanding: Outstanding) -> Routed:
        """Counts the request at its replica until the returned ``Routed`` is settled."""
        blocks = request.block_hashes if self._pending_blocks else ()
        # Its queued prefill: the blocks it computes, and the tier loads of the ones credited, in blocks of prefill.
        return outstanding.add(blocks, max(request.num_blocks - decision.credited, 0) + decision.load_cost)

    def route(self, request: Routable, view: FleetView, refused: tuple[str, ...] = ()) -> tuple[Decision, Routed]:
        decision = self.choose(request, view, refused)
        return decision, self.record(request, decision, view.replicas[decision.replica].outstanding)

    def forget(self, replica: int) -> None:
        """The replica at this position restarted, was replaced or reset: the policy forgets what it sent there."""
        self.policy.forget(replica)
