# The appliance in a container. Data (keys, CA, memory, audit) lives in the /data volume.
# The gateway listens on all interfaces inside the container (the container is the boundary);
# publish only 9443, never the guard.
FROM python:3.11-slim
RUN useradd --create-home --uid 10001 uomp
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip install --no-cache-dir . && mkdir /data && chown uomp /data
USER uomp
ENV UOMP_HOME=/data
VOLUME ["/data"]
EXPOSE 9443
ENTRYPOINT ["uomp"]
CMD ["gateway", "start", "--listen", "0.0.0.0:9443", "--force-non-loopback", "--no-local-port"]
