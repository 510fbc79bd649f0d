{{/*
The daemon pod template, shared by the DaemonSet and the StatefulSet.
*/}}
{{- define "kvstore.podTemplate" -}}
metadata:
  labels:
    {{- include "kvstore.labels" . | nindent 4 }}
    app.kubernetes.io/component: daemon
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "kvstore.config" . | sha256sum }}
    {{- if include "kvstore.auth.generated" . }}
    {{- /* Adding or removing tenants or changing quotas needs a restart; the rest of a
           tenants change waits for SIGHUP (docs/security.md), so only these roll the pods. */}}
    checksum/tenants: {{ include "kvstore.auth.tenantsShape" . | sha256sum }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "kvstore.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
  {{- /* Service links would inject KVSTORE_*_SERVICE_HOST-style variables, which the
         daemon rejects as unknown settings. */}}
  enableServiceLinks: false
  {{- if include "kvstore.hostIPC" . }}
  hostIPC: true
  {{- end }}
  {{- with .Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $chownL3 := include "kvstore.l3.chown" . }}
  {{- $socket := include "kvstore.unixSocket.enabled" . }}
  {{- if or $chownL3 $socket }}
  initContainers:
  {{- end }}
  {{- if $socket }}
    {{- /* The kubelet creates the socket folder as root; the daemon (non-root) binds in it. */}}
    - name: socket-dir
      image: {{ include "kvstore.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["chown", "{{ include "kvstore.daemonOwner" . }}", "/run/kvstore"]
      securityContext:
        runAsUser: 0
        runAsNonRoot: false
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
          add: ["CHOWN"]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: socket
          mountPath: /run/kvstore
  {{- end }}
  {{- if $chownL3 }}
    {{- /* The kubelet creates a missing hostPath folder as root and fsGroup never reaches a
           hostPath: without this the daemon (non-root) cannot write L3. -R also takes over
           files a daemon under another UID left there. */}}
    - name: volume-permissions
      image: {{ include "kvstore.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["chown", "-R", "{{ include "kvstore.daemonOwner" . }}", "{{ .Values.nvme.mountPath }}"]
      securityContext:
        runAsUser: 0
        runAsNonRoot: false
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
          add: ["CHOWN"]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: l3
          mountPath: {{ .Values.nvme.mountPath }}
          {{- if eq .Values.kind "StatefulSet" }}
          subPathExpr: $(POD_NAME)
          {{- end }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
  {{- end }}
  containers:
    - name: kvstore
      image: {{ include "kvstore.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args: ["--config", "/etc/kvstore/kvstore.yaml"]
      {{- if include "kvstore.preStopDrain" . }}
      lifecycle:
        preStop:  # drain visibly (health NOT_SERVING) before the kubelet's SIGTERM, and wait
          exec:
            command:
              {{- $args := include "kvstore.adminArgs" (dict "ctx" . "target" (printf "127.0.0.1:%v" .Values.server.grpcPort) "token" (include "kvstore.auth.ownToken" .) "args" (list "drain" "--wait")) | fromJsonArray }}
              {{- prepend $args "kvstore-admin" | toYaml | nindent 14 }}
      {{- end }}
      env:
        - name: HOME
          value: /tmp
        - name: XDG_CACHE_HOME
          value: /tmp/.cache
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- if and (include "kvstore.unixSocket.enabled" .) (eq .Values.kind "StatefulSet") }}
        - name: KVSTORE_SERVER_UNIX_SOCKET  # replicas on one node share the socket folder
          value: /run/kvstore/$(POD_NAME).sock
        {{- end }}
        {{- if and (include "kvstore.remote.enabled" .) (include "kvstore.remote.hasPassword" .) }}
        - name: KVSTORE_REMOTE_PASSWORD
          valueFrom:
            secretKeyRef:
              name: {{ include "kvstore.secretName" . }}
              key: {{ .Values.remote.existingSecretPasswordKey }}
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ .Values.server.grpcPort }}
          protocol: TCP
        {{- if .Values.server.dataPort }}
        - name: data
          containerPort: {{ .Values.server.dataPort }}
          protocol: TCP
        {{- end }}
        {{- if .Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ .Values.metrics.port }}
          protocol: TCP
        {{- end }}
      {{- range $probe := list "startupProbe" "livenessProbe" "readinessProbe" }}
      {{- $p := index $.Values $probe }}
      {{- if $p.enabled }}
      {{ $probe }}:
        {{- if $.Values.tls.enabled }}
        {{- /* The kubelet's gRPC probe speaks plaintext only; over TLS kvstore-admin asks the
               same grpc.health.v1 service (no credentials needed). */}}
        exec:
          command:
            {{- $args := include "kvstore.adminArgs" (dict "ctx" $ "target" (printf "127.0.0.1:%v" $.Values.server.grpcPort) "timeout" $p.timeoutSeconds "args" (list "health")) | fromJsonArray }}
            {{- prepend $args "kvstore-admin" | toYaml | nindent 12 }}
        {{- else }}
        grpc:
          port: {{ $.Values.server.grpcPort }}
        {{- end }}
        periodSeconds: {{ $p.periodSeconds }}
        timeoutSeconds: {{ $p.timeoutSeconds }}
        failureThreshold: {{ $p.failureThreshold }}
      {{- end }}
      {{- end }}
      resources:
        {{- include "kvstore.resources" . | nindent 8 }}
      securityContext:
        {{- include "kvstore.containerSecurityContext" . | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/kvstore
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- if .Values.dram.enabled }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- if .Values.nvme.enabled }}
        - name: l3
          mountPath: {{ .Values.nvme.mountPath }}
          {{- if and (eq .Values.kind "StatefulSet") (eq .Values.nvme.volume.type "hostPath") }}
          subPathExpr: $(POD_NAME)
          {{- end }}
        {{- end }}
        {{- if .Values.nvme.gds.enabled }}
        - name: udev
          mountPath: /run/udev
          readOnly: true
        {{- end }}
        {{- if include "kvstore.auth.enabled" . }}
        - name: tenants
          mountPath: /etc/kvstore-auth
          readOnly: true
        {{- end }}
        {{- if include "kvstore.auth.ownToken" . }}
        - name: token
          mountPath: /etc/kvstore-token
          readOnly: true
        {{- end }}
        {{- if .Values.tls.enabled }}
        - name: tls
          mountPath: /etc/kvstore-tls
          readOnly: true
        {{- end }}
        {{- if include "kvstore.unixSocket.enabled" . }}
        - name: socket
          mountPath: /run/kvstore
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "kvstore.fullname" . }}
    - name: tmp
      emptyDir:
        sizeLimit: 1Gi
    {{- if .Values.dram.enabled }}
    - name: shm
      {{- if include "kvstore.hostIPC" . }}
      hostPath:
        path: /dev/shm
        type: Directory
      {{- else }}
      emptyDir:
        medium: Memory
        sizeLimit: {{ include "kvstore.shmSizeLimit" . }}
      {{- end }}
    {{- end }}
    {{- if .Values.nvme.enabled }}
    {{- $vol := .Values.nvme.volume }}
    {{- if eq $vol.type "hostPath" }}
    - name: l3
      hostPath:
        path: {{ $vol.hostPath.path }}
        type: {{ $vol.hostPath.type }}
    {{- else if eq $vol.type "emptyDir" }}
    - name: l3
      emptyDir:
        sizeLimit: {{ default (include "kvstore.l3VolumeSize" .) (include "kvstore.quantity" $vol.emptyDir.sizeLimit) }}
    {{- end }}
    {{- end }}
    {{- if .Values.nvme.gds.enabled }}
    - name: udev
      hostPath:
        path: /run/udev
        type: Directory
    {{- end }}
    {{- /* 0440: the files belong to fsGroup, and only the daemon reads them. */}}
    {{- if include "kvstore.auth.enabled" . }}
    - name: tenants
      secret:
        secretName: {{ include "kvstore.auth.tenantsSecretName" . }}
        defaultMode: 0440
        items:
          - key: tenants.yaml
            path: tenants.yaml
    {{- end }}
    {{- if include "kvstore.auth.ownToken" . }}
    - name: token
      secret:
        secretName: {{ include "kvstore.auth.tokenSecretName" . }}
        defaultMode: 0440
    {{- end }}
    {{- if .Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ .Values.tls.secretName }}
        defaultMode: 0440
    {{- end }}
    {{- if include "kvstore.unixSocket.enabled" . }}
    - name: socket
      hostPath:
        path: {{ .Values.unixSocket.hostPath }}
        type: DirectoryOrCreate
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
