# The UOMP appliance in a container: guard + mTLS gateway (and optionally cloudflared, if you
# add it to the image), data in the /data volume. NOT BUILT HERE: no container engine or registry
# is reachable where this was written; see README "Container".
#
# The base image is pinned by digest. This digest (python:3.12.7-slim-bookworm) was taken from
# public Dockerfiles, not pulled or checked here: verify it before you trust it
#   docker buildx imagetools inspect python:3.12.7-slim-bookworm
# and override it with --build-arg PYTHON_IMAGE=python:3.12-slim-bookworm@sha256:<digest you checked>.
ARG PYTHON_IMAGE=python:3.12.7-slim-bookworm@sha256:032c52613401895aa3d418a4c563d2d05f993bc3ecc065c8f4e2280978acd249
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UOMP_HOME=/data

# A fixed non-root uid, so a bind-mounted directory can be chown'ed to it (10001).
RUN useradd --create-home --uid 10001 --user-group uomp \
 && mkdir /data && chown uomp:uomp /data && chmod 0700 /data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip install --no-cache-dir . && rm -rf /root/.cache
COPY --chmod=0755 config/docker-entrypoint.sh /usr/local/bin/uomp-entrypoint

USER uomp
# Keys, CA, memory and audit live here: use a NAMED volume (docker volume create uomp-data),
# or every new container starts with a new CA and new keys.
VOLUME ["/data"]
EXPOSE 9443

# Healthy = the appliance runs, its status file is fresh and its guard answers (uomp status exit 0).
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 CMD ["uomp", "status"]

ENTRYPOINT ["uomp-entrypoint"]
# Inside the container the gateway listens on all interfaces (the container is the boundary);
# publish only 9443, never the guard. UOMP_HOSTNAME=my-box.example names the public address.
CMD ["gateway", "start", "--listen", "0.0.0.0:9443", "--force-non-loopback", "--no-local-port"]
