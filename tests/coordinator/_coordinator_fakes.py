"""A test-local strategy implementing exactly the contract the coordinator relies on."""

from unison._cluster import multi_worker_util


class FakeExtended:
    def __init__(self, between_graph=True):
        self.experimental_between_graph = between_graph
        self.should_checkpoint = True
        self.should_save_summary = True
        self.experimental_should_init = True


class FakeStrategy:
    """Records its ``configure`` call; only the chief checkpoints, as multi-worker strategies do."""

    def __init__(self, between_graph=True):
        self.extended = FakeExtended(between_graph)
        self.configured = "never"

    def configure(self, cluster_spec=None, task_type=None, task_id=None, rendezvous=None):
        self.configured = (cluster_spec.as_dict() if cluster_spec else None, task_type, task_id)
        self.rendezvous = rendezvous
        chief = multi_worker_util.is_chief(cluster_spec, task_type, task_id) if cluster_spec else True
        self.extended.should_checkpoint = chief
        self.extended.should_save_summary = chief
