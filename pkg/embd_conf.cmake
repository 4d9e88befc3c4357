# Writes the packaged /etc/embd/embd.conf: embd's embedded default (its demonstration tables
# and topology, in the layout an operator edits) plus what the packaged service needs: the
# socket's peers (root and group embd) and checkpoints in the unit's StateDirectory.
# cmake -DEMBD=path/to/embd -DOUT=embd.conf -P embd_conf.cmake
execute_process(COMMAND ${EMBD} --print-default-config OUTPUT_VARIABLE text
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${EMBD} --print-default-config failed (${rc})")
endif()
set(packaged
  "  \"allowed_uids\": [0],\n"
  "  \"allowed_gids\": [\"embd\"],\n"
  "  \"checkpoint_dir\": \"/var/lib/embd\"\n")
string(JOIN "" packaged ${packaged})
# the default's last key ends without a comma before the closing brace
string(REGEX REPLACE "\n}\n$" ",\n${packaged}}\n" conf "${text}")
if(conf STREQUAL text)
  message(FATAL_ERROR "embd --print-default-config no longer ends in \"\\n}\\n\"")
endif()
string(JSON checked GET "${conf}" checkpoint_dir)   # fails the build on broken JSON
file(WRITE ${OUT} "${conf}")
