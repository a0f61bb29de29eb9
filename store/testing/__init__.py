"""Local S3 for tests, notebooks and benchmarks (the ``reshard[testing]`` extra).

``s3server.LocalS3Server``: an in-process moto server on loopback.
``s3proxy.S3Proxy``: a counting, fault-injecting proxy in front of any S3 endpoint.
``shaped.ShapedCloud``: nginx and an S3 server in a network namespace behind a shaped link (rate, RTT).
``motoserve``: moto's S3 served with kept-alive connections (the shaped cloud's S3 server, run as a script).
``service``: what both share (``LocalService``, ``REGION``, ``s3_storage_options``).
Nothing here is imported by the runtime package; moto is imported lazily.
"""

from .s3proxy import ProxyRecord, S3Proxy
from .s3server import LocalS3Server
from .service import s3_storage_options
from .shaped import ShapedCloud, ShapedCloudUnavailable

__all__ = ["LocalS3Server", "ProxyRecord", "S3Proxy", "ShapedCloud", "ShapedCloudUnavailable", "s3_storage_options"]
