"""The chief's side of ParameterServerStrategy (run in the chief's process): ``ClusterCoordinator``
schedules functions onto workers through its closure queue and hands back ``RemoteValue``s;
per-worker datasets are built on the workers by functions it sends."""

__all__: list[str] = []
